"""The `quantkit` command line (contract: CLI.md). Each command parses flags and calls one library function."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from quantkit.errors import QuantkitError

app = typer.Typer(
    name="quantkit",
    help="Inspect, convert and serve compressed-tensors checkpoints on TPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_state = {"debug": False}


class Target(str, Enum):
    v5e = "v5e"
    v6e = "v6e"
    v7x = "v7x"
    cpu = "cpu"


def _fail(err: BaseException) -> typer.Exit:
    """One line on stderr, the error's exit code; the traceback only with --debug."""
    if _state["debug"]:
        raise err
    if isinstance(err, QuantkitError):
        msg, code = str(err), err.exit_code
    elif isinstance(err, KeyboardInterrupt):
        msg, code = "interrupted", 130
    else:
        msg, code = f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", 1
    print(f"error: {msg}", file=sys.stderr)
    return typer.Exit(code)


def _human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def _print_report(r: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    out = Console() if sys.stdout.isatty() else Console(width=160)
    title = f"{r['path']}  ·  {r['architecture'] or 'unknown architecture'}  ·  " \
            f"{r['format'] or 'unquantized'}  ·  target {r['target']}"
    table = Table(title=title, title_justify="left")
    for col in ("layers", "kind", "format", "scheme", "path", "example"):
        table.add_column(col, justify="right" if col == "layers" else "left")
    groups: dict[tuple, list[dict]] = {}
    for layer in r["layers"]:
        s = layer["scheme"]
        scheme = "-" if s is None else (
            f"{s['type']}{s['num_bits']} {s['strategy']}"
            + (f" g{s['group_size']}" if s["strategy"] == "group" else "")
            + ("" if s["symmetric"] else " asym") + (f" actorder={s['actorder']}" if s["actorder"] else ""))
        path = layer["path"] or ("[red]not servable[/]" if not layer["servable"] else "-")
        groups.setdefault((layer["kind"], layer["format"], scheme, path), []).append(layer)
    for (kind, fmt, scheme, path), members in groups.items():
        table.add_row(str(len(members)), kind, fmt, escape(scheme), path, escape(members[0]["name"]))
    out.print(table)

    by_msg: dict[tuple[str, str], list[str]] = {}
    for p in r["problems"]:
        by_msg.setdefault((p["severity"], p["message"]), []).append(p["where"])
    colors = {"error": "red", "unsupported": "yellow", "warning": "cyan"}
    for (sev, msg), wheres in by_msg.items():
        where = wheres[0] if len(wheres) == 1 else f"{len(wheres)} layers, e.g. {wheres[0]}"
        text = msg if wheres[0] in msg and len(wheres) == 1 else f"{msg} [{where}]"
        out.print(f"[{colors[sev]}]{sev}[/]: {escape(text)}", highlight=False)
    bpw = f"{r['bits_per_weight']:.2f}" if r["bits_per_weight"] else "-"
    cap = f" of {_human_size(r['hbm_capacity'])}" if r["hbm_capacity"] else ""
    out.print(f"{r['num_tensors']} tensors in {r['num_files']} file(s), {_human_size(r['bytes_on_disk'])} on disk; "
              f"weights need {_human_size(r['hbm_bytes_weights'])}{cap} on {r['target']}; "
              f"{bpw} bits per {'quantized' if r['format'] else 'linear'} weight", highlight=False)
    verdict = {0: "[green]servable[/]", 1: "[red]invalid[/]", 3: "[yellow]not servable[/]"}[r["exit_code"]]
    out.print(f"verdict: {verdict}")


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory or .safetensors file.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    target: Annotated[Target, typer.Option(help="Device the runtime would serve on.")] = Target.v6e,
    deep: Annotated[bool, typer.Option("--deep", help="Also read tensor data: NaN/Inf/zero scales, weight_shape.")] = False,
) -> None:
    """Describe a checkpoint, validate it, and say which layers the runtime can serve on TARGET.

    Reads only headers unless --deep. Exit codes: 0 valid and servable, 1 invalid or corrupt,
    3 valid but not servable.

    Example:  quantkit inspect ./Llama-3.1-8B-W4A16 --target v6e --json
    """
    from quantkit.inspect import inspect_checkpoint

    try:
        if deep and sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            with Progress("checking", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                          transient=True) as bar:
                task = bar.add_task("read", total=None)
                report = inspect_checkpoint(path, target.value, True,
                                            lambda done, total: bar.update(task, completed=done, total=total))
        else:
            report = inspect_checkpoint(path, target.value, deep)
    except (QuantkitError, KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None
    if json_out:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        _print_report(report)
    raise typer.Exit(report["exit_code"])


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
