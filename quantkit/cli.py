"""The `quantkit` command line (contract: docs/cli.md). Each command parses flags and calls one library function."""

from __future__ import annotations

import functools
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from quantkit.errors import InvalidInput, QuantkitError
from quantkit.formats.ct_writer import SCHEMES
from quantkit.runtime.config import MAX_NUM_BATCHED_TOKENS

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


def _with_progress(label: str, fn, counted: bool = False):
    """fn(progress) with a progress bar on stderr (bytes with speed, or `counted` items) when stderr is a
    terminal, else fn(None)."""
    if not sys.stderr.isatty():
        return fn(None)
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = (MofNCompleteColumn(),) if counted else (DownloadColumn(), TransferSpeedColumn())
    with Progress(label, BarColumn(), *columns, TimeRemainingColumn(), transient=True,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=None)
        return fn(lambda done, total: bar.update(task, completed=done, total=total))


def _emit(report: dict, json_out: bool, printer) -> None:
    """One JSON document on stdout, or the human rendering."""
    if json_out:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        printer(report)


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
    fmt = r['format'] or 'unquantized'
    if r["format"] and r["quant_method"] not in (None, "compressed-tensors"):  # gpt-oss's own layout
        fmt = f"quant_method {r['quant_method']}, read as {fmt}"
    title = f"{r['path']}  ·  {r['architecture'] or 'unknown architecture'}  ·  {fmt}  ·  target {r['target']}"
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
    kv = r.get("kv_cache_scheme")
    if kv:
        out.print(f"KV cache scheme: {kv['type']}{kv['num_bits']} {kv['strategy']} scales (serve's --kv-cache-dtype "
                  "auto runs an FP8 E4M3 cache with them)", highlight=False)
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
        report = (_with_progress("checking", lambda progress: inspect_checkpoint(path, target.value, True, progress))
                  if deep else inspect_checkpoint(path, target.value))
    except (QuantkitError, KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None
    _emit(report, json_out, _print_report)
    code = report["exit_code"]
    if code:  # the one-line error of docs/cli.md: the first problem of the kind that set the exit code
        first = next(p for p in report["problems"] if p["severity"] == ("error" if code == 1 else "unsupported"))
        text = first["message"] if first["where"] in first["message"] else f"{first['where']}: {first['message']}"
        more = sum(p["severity"] in ("error", "unsupported") for p in report["problems"]) - 1
        tail = f" (and {more} more problem{'s' * (more > 1)}: see the report)" if more else ""
        print(f"error: {report['path']}: {text}{tail}", file=sys.stderr)
    raise typer.Exit(code)


SchemeName = Enum("SchemeName", {s: s for s in SCHEMES}, type=str)  # convert's and plan's --scheme


class Observer(str, Enum):
    minmax = "minmax"
    mse = "mse"


def _print_convert(r: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    out = Console() if sys.stdout.isatty() else Console(width=160)
    q = [t for t in r["tensors"] if t["action"] == "quantize"]
    if q:
        mse = r["observer"] == "mse"
        table = Table(title=f"worst {min(10, len(q))} of {len(q)} quantized tensors", title_justify="left")
        for col in ("tensor", "shape", "rel. error", "SQNR dB") + (("min-max rel. error",) if mse else ()):
            table.add_column(col, justify="left" if col == "tensor" else "right")
        for t in sorted(q, key=lambda t: -t["rel_error"])[:10]:
            row = [escape(t["name"]), "x".join(map(str, t["shape"])), f"{t['rel_error']:.4f}",
                   f"{t['sqnr_db']:.1f}" if t["sqnr_db"] is not None else "inf"]
            if mse:
                row.append(f"{t.get('rel_error_minmax', t['rel_error']):.4f}")
            table.add_row(*row)
        out.print(table)
        gain = ""
        if "mean_rel_error_minmax" in r:
            gain = (f" (min-max: {r['mean_rel_error_minmax']:.4f}, "
                    f"{100 * (1 - r['mean_rel_error'] / r['mean_rel_error_minmax']):.1f}% lower with mse)")
        out.print(f"mean relative error {r['mean_rel_error']:.4f}{gain}", highlight=False)
    out.print(f"wrote {r['dst']}: {r['num_shards']} shard(s), {_human_size(r['bytes_out'])} "
              f"from {_human_size(r['bytes_in'])} with {r['workers']} worker(s); "
              f"ignored: {', '.join(r['ignore']) or 'none'}", highlight=False)


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Source checkpoint directory (bf16/fp16/fp32, or compressed-tensors "
                                        "for DENSE).", show_default=False)],
    dst: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).", show_default=False)],
    scheme: Annotated[SchemeName, typer.Option(help="Target scheme (compressed-tensors preset names).")] = SchemeName.W4A16,
    group_size: Annotated[int, typer.Option(help="W4A16 / W8A16 (and _ASYM) group size; -1 = one scale per output channel.")] = 128,
    ignore: Annotated[list[str] | None, typer.Option(help="Module name or re:<regex> to keep unquantized "
                                                      "(repeatable).")] = None,
    observer: Annotated[Observer, typer.Option(help="minmax, or mse: per group, the clipping ratio with the "
                                               "least error.")] = Observer.minmax,
    workers: Annotated[int | None, typer.Option(help="Tensors quantized in parallel (default: one per "
                                                "available core, at most 8).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing DST.")] = False,
    quantize_lm_head: Annotated[bool, typer.Option("--quantize-lm-head", help="Also quantize lm_head.")] = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB or 500MB.")] = "5GB",
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON document.")] = False,
) -> None:
    """Quantize SRC into a compressed-tensors checkpoint at DST, tensor by tensor, in bounded memory.

    Embeddings, norms, lm_head, MoE router gates and vision towers stay unquantized. DST is written to a
    temporary directory beside it, .DST.quantkit-tmp-PID-..., on the same filesystem, so that one rename
    publishes it at the end; an interrupted run leaves no DST. A convert killed outright (SIGKILL) leaves
    that temporary behind: the next convert to the same DST removes it once its process is gone, and says so.

    Example:  quantkit convert ./Llama-3.1-8B ./Llama-3.1-8B-W4A16 --scheme W4A16 --group-size 128
    """
    from quantkit.convert import convert as run, parse_size

    try:
        args = dict(scheme=scheme.value, group_size=group_size, ignore=ignore or [], observer=observer.value,
                    workers=workers, force=force, quantize_lm_head=quantize_lm_head,
                    max_shard_bytes=parse_size(max_shard_size))
        report = _with_progress("converting", lambda progress: run(src, dst, **args, progress=progress))
    except (QuantkitError, KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None
    for t in report["removed_stale"]:
        print(f"removed stale temporary {t['path']} ({_human_size(t['bytes'])}) left by a killed convert "
              f"(pid {t['pid']})", file=sys.stderr)
    _emit(report, json_out, _print_convert)


class LoadFormat(str, Enum):  # vLLM's --load-format values quantkit takes
    auto = "auto"
    dummy = "dummy"


class KvCacheDtype(str, Enum):  # runtime/cache.py KV_CACHE_DTYPES (vLLM's names)
    auto = "auto"
    bf16 = "bf16"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"


TpOption = Annotated[int, typer.Option("--tp", "--tensor-parallel-size", min=1,
                                      help="Devices to split the model over (tensor parallel; vLLM's "
                                           "--tensor-parallel-size). Heads, MLP widths and experts must divide it.")]
EpOption = Annotated[bool, typer.Option("--enable-expert-parallel",
                                        help="With --tp: MoE experts split whole over the devices (each runs its "
                                             "own experts; one all-reduce combines) instead of each expert split "
                                             "over all of them.")]
DpOption = Annotated[int, typer.Option("--data-parallel-size", min=1,
                                      help="Devices that each serve their own sequences with a whole copy of the "
                                           "weights (vLLM's --data-parallel-size; with --enable-expert-parallel "
                                           "the MoE experts split over them instead). --max-num-seqs must be a "
                                           "multiple; not with --tp.")]
CoordinatorOption = Annotated[str | None, typer.Option(
    help="Join a multi-process run (jax.distributed): HOST:PORT of process 0 (with --num-processes and "
         "--process-id), or 'auto' on a TPU slice. Start the same command on every host; process 0 prints the "
         "output or serves HTTP.", show_default=False)]
NumProcessesOption = Annotated[int | None, typer.Option(min=1, help="Processes in the run.", show_default=False)]
ProcessIdOption = Annotated[int | None, typer.Option(min=0, help="This process's index (0 schedules).",
                                                      show_default=False)]
SpecOption = Annotated[str | None, typer.Option(
    "--speculative-config", help="Speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 4}', or '{\"method\": \"eagle3\", \"model\": \"assets/tiny-llama-eagle3\", "
    "\"num_speculative_tokens\": 3}' (keys: method, num_speculative_tokens, prompt_lookup_min / _max, model; "
    "docs/serving.md). Output unchanged: token for token when greedy or seeded.", show_default=False)]


def _speculative(text: str | None):
    """--speculative-config parsed (runtime/speculative.py); a usage error (exit 2) naming what is wrong."""
    from quantkit.runtime.speculative import parse

    try:
        return parse(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--speculative-config") from None
    except QuantkitError as e:
        raise _fail(e) from None


def _stdout_for_output_only() -> None:
    """In a multi-process run, libraries (gloo) write status lines to file descriptor 1: point it at stderr
    and keep the real stdout for the command's output alone."""
    import os

    sys.stdout.flush()
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(out, "w")


def _choose_backend() -> None:
    """The CPU, quietly, when no TPU is attached (runtime/backend.py); says so in one line on stderr."""
    from quantkit.runtime.backend import choose_backend

    if line := choose_backend():
        print(line, file=sys.stderr)


KV_HELP = ("KV cache storage: auto = FP8 (E4M3) with the checkpoint's k/v scales when it has a kv_cache_scheme, "
           "else the model's dtype; fp8 = fp8_e4m3; without checkpoint scales FP8 uses 1.0.")


@app.command()
def generate(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (dense or compressed-tensors).",
                                         show_default=False)],
    prompt: Annotated[str, typer.Option(help="The prompt text.", show_default=False)],
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Sample among the k most likely tokens; 0 = all.")] = 0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    max_model_len: Annotated[int, typer.Option(min=2, help="KV cache length (prompt + output).")] = 2048,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help=KV_HELP)] = KvCacheDtype.auto,
    tp: TpOption = 1,
    enable_expert_parallel: EpOption = False,
    data_parallel_size: DpOption = 1,
    coordinator_address: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
    speculative_config: SpecOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="No streaming: one JSON document on stdout (text, "
                                                          "tokens, timings, speculative acceptance).")] = False,
) -> None:
    """Load PATH with the JAX runtime and stream a completion of PROMPT to stdout.

    Examples: quantkit generate ./Llama-3.2-1B-Instruct-W4A16 --prompt "Why is the sky blue?" --chat
              quantkit generate ./Qwen3-30B-A3B-W4A16 --prompt "Hi" --tp 4 --enable-expert-parallel
              quantkit generate assets/tiny-llama --prompt "def add(a, b):" --json
                  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    """
    speculative = _speculative(speculative_config)
    try:
        _choose_backend()
        from quantkit.generate import generate as run

        if coordinator_address is not None:
            _stdout_for_output_only()

        def loaded(model, where: str) -> None:
            print(f"loaded {model.cfg.family} ({model.cfg.num_layers} layers): weights take "
                  f"{_human_size(model.weight_bytes)} on {where}", file=sys.stderr)

        def stream(text: str) -> None:
            if not json_out:
                sys.stdout.write(text)
                sys.stdout.flush()

        r = run(path, prompt, max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
                stop=stop or (), max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype.value, tp=tp,
                ep=enable_expert_parallel, dp=data_parallel_size, distributed=(coordinator_address, num_processes, process_id),
                on_text=stream, on_loaded=loaded, speculative=speculative)
        if r is not None and json_out:
            _emit(r.report(), True, None)
        elif r is not None:  # None: a process other than the first of a multi-process run
            sys.stdout.write("\n")
            spec = r.speculative
            accepted = (f"; drafts accepted {spec['accepted_tokens']} / {spec['draft_tokens']}, "
                        f"{spec['mean_tokens_per_step']:.2f} tokens a decode step" if spec else "")
            print(f"{r.prompt_tokens} prompt tokens; {len(r.tokens)} generated in {r.seconds:.2f} s, the first after "
                  f"{r.first_token_seconds:.2f} s, then {r.tokens_per_second:.1f} tokens/s ({r.finish_reason})"
                  f"{accepted}", file=sys.stderr)
    except (QuantkitError, KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None


class TpuTarget(str, Enum):
    v5e = "v5e"
    v6e = "v6e"
    v7x = "v7x"


@app.command()
def plan(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory or a bare config.json.", show_default=False)],
    target: Annotated[TpuTarget, typer.Option(help="TPU generation to compile for.")] = TpuTarget.v6e,
    max_model_len: Annotated[int, typer.Option(min=16, help="Prompt + output tokens per sequence.")] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = 16,
    tp: Annotated[int, typer.Option(help="Tensor-parallel devices: 1, 2, 4 or 8; HBM is then reported per "
                                         "device. v5e / v6e: chips (a 1x2, 2x2 or 2x4 slice); v7x: TensorCores, "
                                         "two a chip (tpu7x 1x1x1, 1x2x1, 2x2x1).")] = 1,
    scheme: Annotated[SchemeName | None, typer.Option(help="How the weights would be stored \\[default: as the "
                                                           "checkpoint says; bf16 without a quantization_config].",
                                                      show_default=False)] = None,
    group_size: Annotated[int, typer.Option(help="W4A16 / W8A16 (and _ASYM) group size (-1: channel).")] = 128,
    search: Annotated[bool, typer.Option(help="Also find the largest --max-num-seqs that fits.")] = True,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help=KV_HELP)] = KvCacheDtype.auto,
    enable_expert_parallel: EpOption = False,
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", help="Data-parallel devices (1, 2, 4 "
                                                    "or 8, with --tp 1): each holds the weights (with "
                                                    "--enable-expert-parallel, its share of the experts) and "
                                                    "--max-num-seqs / N sequences; figures per device.")] = 1,
    cost: Annotated[bool, typer.Option(help="Also XLA's cost analysis of the decode step (bytes, FLOPs, "
                                            "collectives): a few more, smaller compiles.")] = True,
    speculative_config: SpecOption = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="As serve's: with Gated DeltaNet layers (Qwen3.5), "
                                                             "count the state slots of its prefix snapshots "
                                                             "(--max-num-seqs more).")] = True,
    max_num_batched_tokens: Annotated[int, typer.Option(min=8, help="As serve's: the most tokens one step "
                                                                    "runs (its largest program).")]
    = MAX_NUM_BATCHED_TOKENS,
    timings: Annotated[bool, typer.Option("--timings", help="Also each compile's trace, lower and compile "
                                                            "seconds (--json: always, compile_timings).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
) -> None:
    """Compile the serving steps for a TPU without one (libtpu, deviceless) and report HBM for weights, KV
    cache and temporaries, per-kernel VMEM, compile time, and whether it fits (exit 4 when it does not).

    Examples:  quantkit plan ./gemma-3-27b-it/config.json --scheme W4A16 --group-size 32
               quantkit plan ./gemma-3-27b-it --scheme DENSE --tp 4 --json
               quantkit plan ./Qwen3-30B-A3B/config.json --scheme W4A16 --tp 4 --enable-expert-parallel
               quantkit plan ./Qwen3.5-397B-A17B --scheme W4A16 --target v7x --tp 4 --enable-expert-parallel
               quantkit plan ./Qwen3.5-397B-A17B --scheme W4A16 --target v7x --data-parallel-size 8
                   --enable-expert-parallel --max-num-seqs 512 --max-model-len 9216
               quantkit plan ./Llama-3.1-8B/config.json --scheme W4A16 --speculative-config
                   '{"method": "ngram", "num_speculative_tokens": 4}'   (the verifying step's cost too)
    """
    for n, flag in ((tp, "--tp"), (data_parallel_size, "--data-parallel-size")):
        if n not in (1, 2, 4, 8):
            raise typer.BadParameter(f"{n} devices: plans cover 1, 2, 4 or 8", param_hint=flag)
    speculative = _speculative(speculative_config)
    try:
        from quantkit.plan import plan as run, print_plan

        def note(msg: str) -> None:
            if sys.stderr.isatty():
                print(msg, file=sys.stderr)

        report = run(path, target.value, max_model_len, max_num_seqs, tp,
                     scheme.value if scheme is not None else None, group_size, search, note, kv_cache_dtype.value,
                     enable_expert_parallel, cost, speculative=speculative,
                     prefix_caching=enable_prefix_caching, dp=data_parallel_size,
                     max_num_batched_tokens=max_num_batched_tokens)
        _emit(report, json_out, functools.partial(print_plan, timings=timings))
    except (QuantkitError, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None
    raise typer.Exit(0 if report["fits"] else 4)


@app.command("eval")
def eval_(
    reference: Annotated[Path, typer.Argument(help="The checkpoint to compare against (e.g. bf16).",
                                              show_default=False)],
    candidate: Annotated[Path, typer.Argument(help="The checkpoint under test (e.g. its W4A16 conversion).",
                                              show_default=False)],
    text: Annotated[Path | None, typer.Option(help="UTF-8 text to evaluate on \\[default: the source of "
                                                   "Python's argparse module].", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option(min=2, help="Tokens of the text to use at most.")] = 4096,
    window: Annotated[int, typer.Option(min=2, help="Tokens per independent window (context length).")] = 512,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help="The CANDIDATE's KV cache (the reference's is "
                                                              "auto). " + KV_HELP)] = KvCacheDtype.auto,
    tp: TpOption = 1,
    enable_expert_parallel: EpOption = False,
    speculative_config: Annotated[str | None, typer.Option(
        "--speculative-config", help="Accepted (and checked) so that serve's flags can be reused; eval scores "
                                     "every position's logits in one pass, which speculation does not change.",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
) -> None:
    """Quality lost by CANDIDATE against REFERENCE on the same text: KL divergence of the next-token
    distributions (mean, median, 99th percentile, max), both perplexities and top-1 agreement, with
    paired-bootstrap 95% intervals.

    Examples: quantkit eval models/tiny-llama models/tiny-llama-W4A16 --text notes.txt
              quantkit eval models/tiny-llama models/tiny-llama --kv-cache-dtype fp8_e4m3   (FP8 KV vs bf16)
    """
    _speculative(speculative_config)
    try:
        _choose_backend()
        from quantkit.evaluate import evaluate, print_report

        if text is not None:
            try:
                content = text.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidInput(f"{text}: cannot read the text: {e}") from None
        else:
            content = None
        report = _with_progress("Evaluating windows", lambda p: evaluate(reference, candidate, content, max_tokens,
                                                                        window, p, kv_cache_dtype.value,
                                                                        tp, enable_expert_parallel),
                                      counted=True)
        _emit(report, json_out, print_report)
    except (QuantkitError, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None


@app.command()
def serve(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (dense or compressed-tensors) with its tokenizer.",
                                         show_default=False)],
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes the server to the network.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0 = any free port, printed).")] = 8000,
    uds: Annotated[str | None, typer.Option(help="Listen on this Unix socket path instead of --host/--port "
                                                 "(mode 0600; a stale socket file is replaced, removed at exit).",
                                            show_default=False)] = None,
    max_model_len: Annotated[int | None, typer.Option(min=2, help="Prompt + output tokens per request "
                                                              "\\[default: the model's, at most 2048].")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Requests decoded together (KV cache slots).")] = 16,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id clients send \\[default: PATH's name].")]
    = None,
    max_num_batched_tokens: Annotated[int, typer.Option(min=8, help="Tokens one step runs at most: decodes "
                                                                    "first, prompt chunks fill the rest.")]
    = MAX_NUM_BATCHED_TOKENS,
    max_waiting: Annotated[int, typer.Option(min=0, help="Queued requests beyond which the server answers 429.")]
    = 256,
    grace: Annotated[float, typer.Option(min=0, help="Seconds SIGTERM waits for in-flight requests.")] = 30.0,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse the cached KV pages of earlier prompts a new "
                                                             "prompt starts with (vLLM's automatic prefix "
                                                             "caching).")] = True,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help=KV_HELP)] = KvCacheDtype.auto,
    tp: TpOption = 1,
    enable_expert_parallel: EpOption = False,
    data_parallel_size: DpOption = 1,
    coordinator_address: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
    speculative_config: SpecOption = None,
    load_format: Annotated[LoadFormat, typer.Option(help="auto: the checkpoint's weights; dummy: random weights "
                                                         "of the types config.json's quantization_config names, "
                                                         "no safetensors read (vLLM's; for measuring a model's "
                                                         "shape without its weights).")] = LoadFormat.auto,
) -> None:
    """Serve PATH over an OpenAI-compatible HTTP API (completions and chat, streaming, logprobs).

    /health answers at once; /ready turns 200 after the weights are loaded and every shape is compiled
    (a restart with the same model and flags reuses the compilation cache). SIGTERM drains and exits 0.

    Examples: quantkit serve models/tiny-llama-W4A16 --port 8000
              quantkit serve ./gemma-3-27b-it --tp 4      (one v6e:2x2 host)
              quantkit serve ./Qwen3.5-35B-A3B-W4A16 --data-parallel-size 4 --enable-expert-parallel --max-num-seqs 64
              quantkit serve assets/tiny-llama --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
              quantkit serve assets/tiny-llama --speculative-config
                  '{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": 3}'
              quantkit serve models/tiny-llama-W4A16 --uds /tmp/quantkit.sock   (no TCP: a TPU VM, a sandbox)
              quantkit serve ./llama-3-8b-shape --load-format dummy   (config.json, tokenizer; random weights)
              curl localhost:8000/v1/completions -H 'Content-Type: application/json'
                   -d '{"model": "tiny-llama-W4A16", "prompt": "Hello", "max_tokens": 16}'
              curl --unix-socket /tmp/quantkit.sock http://localhost/v1/models
    """
    speculative = _speculative(speculative_config)
    try:
        _choose_backend()
        from quantkit.runtime.server import serve as run

        code = run(path, host, port, uds=uds, served_model_name=served_model_name, max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, api_key=api_key, max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting,
                   grace=grace, enable_prefix_caching=enable_prefix_caching,
                   kv_cache_dtype=kv_cache_dtype.value, tp=tp, ep=enable_expert_parallel, dp=data_parallel_size,
                   distributed=(coordinator_address, num_processes, process_id), speculative=speculative,
                   load_format=load_format.value)
    except (QuantkitError, Exception) as e:  # noqa: BLE001 - one line, never a traceback
        raise _fail(e) from None
    raise typer.Exit(code)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
