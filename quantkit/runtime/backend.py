"""The JAX backend `generate`, `serve` and `eval` run on, settled before JAX starts one.

With libtpu installed (the tpu and dev extras) JAX tries the TPU first even where none is attached: libtpu
then spends seconds looking for one and prints its initialisation errors (worker hostnames, accelerator
type) before JAX falls back to the CPU. The PCI bus, which JAX's own Cloud TPU set-up reads, says whether a
TPU is there without loading libtpu; where it shows none but a TPU's device files exist (a container that
hides the bus), JAX is left to look, so that a TPU is never passed over.
"""

from __future__ import annotations

from pathlib import Path

GOOGLE_VENDOR = "0x1ae0"
TPU_DEVICE_IDS = {"0x0027": "v3", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e",
                  "0x0076": "v7x"}  # the PCI device ids of JAX's hardware_utils; Google's others (gVNIC) are not TPUs


def tpu_chips(devices: Path = Path("/sys/bus/pci/devices")) -> list[str]:
    """The generation ("v6e", ...) of each TPU chip on this host's PCI bus."""
    chips = []
    for dev in sorted(devices.glob("*")):
        try:
            vendor, device = ((dev / f).read_text().strip() for f in ("vendor", "device"))
        except OSError:
            continue
        if vendor == GOOGLE_VENDOR and device in TPU_DEVICE_IDS:
            chips.append(TPU_DEVICE_IDS[device])
    return chips


def tpu_device_files(dev: Path = Path("/dev")) -> list[str]:
    """Device files a TPU driver makes: /dev/accel* (up to v4), /dev/vfio/<group> (v5e and later, and any other
    device passed through VFIO)."""
    return sorted(str(p) for p in (*dev.glob("accel*"), *dev.glob("vfio/[0-9]*")))


def choose_backend() -> str | None:
    """Sets JAX on the CPU, quietly, when neither a TPU nor a TPU's device files are found; call it before
    anything starts a JAX backend.

    Returns the line that says which backend serves, e.g. "backend: cpu (no TPU found)", or None when the
    user chose one (JAX_PLATFORMS or jax.config's jax_platforms), which is kept as it is.
    """
    import jax

    if jax.config.jax_platforms:
        return None
    if chips := tpu_chips():
        return f"backend: tpu ({len(chips)} x TPU {chips[0]})"
    if files := tpu_device_files():
        return f"backend: JAX's choice ({files[0]} may be a TPU's)"
    jax.config.update("jax_platforms", "cpu")
    return "backend: cpu (no TPU found)"
