"""Generate ``docs/COVERAGE.md``: which models whitenlayers converts, trains and exports exactly.

Usage::

    python docs/coverage.py                   # every torchvision classification builder (+ timm families if installed)
    python docs/coverage.py --self-test       # also the stand-ins of whitenlayers.models (no torchvision needed)
    python docs/coverage.py --models resnet50,mobilenet_v2 --out /tmp/coverage.md

torchvision's models are ``torchvision.models.list_models(module=torchvision.models)``,
built untrained (``weights=None``); timm's are the smallest model (fewest
parameters) of each of ``timm.list_modules()``, at its default input size; Hugging Face's are
``ResNetForImageClassification`` (ResNet-50 and ResNet-18 layouts). Without
torchvision, timm or transformers their table is left pending with a note
saying so, and the script still succeeds.

For each model, method and conversion (default targets: convolutions inside
residual blocks; ``targets="all"``: every conv and linear layer but the stem
and the classifier; both with ``example_input``, so that layers the model does
not call as modules, e.g. torchvision's Swin attention projections, are left
out and reported) it records:

* layers converted (grouped / depthwise among them) and layers left out that
  the rule selected but that cannot be converted (``ConversionReport.unsupported``);
* function preserved at conversion: the max relative difference of the
  eval-mode outputs, converted against plain (``|a - b|_max / |b|_max``);
* three SGD training steps (``block_size=2``, so one fold happens) with a
  finite loss and finite parameters, and every converted layer called (it saw
  its input: a layer whose weight the model uses functionally does not);
* export exact: max relative difference of :func:`whitenlayers.to_plain_model`'s
  plain model against the converted model, eval mode;
* conversion time.

A row is ``ok`` when the conversion difference is at most 1e-5, the steps are
finite, every converted layer was called and the export difference is at
most 1e-4. The exit status is 1 when a row failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # (the package, and the tests' stand-ins of other families)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
import stand_ins  # noqa: E402
import whitenlayers as wl  # noqa: E402
from whitenlayers.experiment.report import git_state  # noqa: E402

TARGETS = ("blocks", "all")
CONVERSION_TOL = 1e-5
EXPORT_TOL = 1e-4
#: torchvision models that need a particular input size (others run at --size): Inception-v3's auxiliary
#: classifier (training mode) needs 17x17 features (299x299 inputs), MaxViT and ViT a fixed size.
TORCHVISION_SIZES = {"inception_v3": 299, "maxvit_t": 224, "vit_b_16": 224, "vit_b_32": 224, "vit_l_16": 224,
                     "vit_l_32": 224, "vit_h_14": 224}


@dataclass
class Row:
    model: str
    method: str
    targets: str
    converted: int = 0
    grouped: int = 0
    unsupported: Dict[str, str] = field(default_factory=dict)
    conversion_diff: float = math.nan
    finite: bool = False
    uncalled: List[str] = field(default_factory=list)
    export_diff: float = math.nan
    seconds: float = math.nan
    error: str = ""
    #: why the checks did not run to the end on this machine (time or memory limit of ``--isolate``)
    not_run: str = ""
    #: wall time of the whole check (build, conversion, steps, export)
    check_seconds: float = math.nan

    @property
    def ok(self) -> bool:
        if self.error or self.not_run:
            return False
        if self.converted == 0:
            return True  # nothing to check (e.g. no residual block for the default targets)
        return (self.conversion_diff <= CONVERSION_TOL and self.finite and not self.uncalled
                and self.export_diff <= EXPORT_TOL)

    @property
    def status(self) -> str:
        if self.not_run:
            return f"not run: {self.not_run}"
        if self.error:
            return f"FAIL: {self.error}"
        if self.converted == 0:
            return "nothing converted"
        if self.ok:
            return "ok"
        why = []
        if not self.conversion_diff <= CONVERSION_TOL:
            why.append("function changed at conversion")
        if not self.finite:
            why.append("non-finite training")
        if self.uncalled:
            why.append(f"{len(self.uncalled)} layer(s) never called, e.g. {self.uncalled[0]}")
        if not self.export_diff <= EXPORT_TOL:
            why.append("export not exact")
        return "FAIL: " + "; ".join(why)


def _logits(out):
    """The main output of a model (torchvision's Inception / GoogLeNet return named tuples in training mode)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def check(name: str, build: Callable[[], nn.Module], shape: Tuple[int, ...], method: str, targets: str, *,
          block_size: int = 2, steps: int = 3, device: str = "cpu") -> Row:
    """The coverage checks of one model, method and target option."""
    row = Row(name, method, targets)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = build().to(device).eval()  # converted in place: one copy of the weights (giant models)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g).to(device)
        with torch.no_grad():
            ref = _logits(model(x))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what is left out is in the report
            model, report = wl.convert_model(model, method, targets=targets, block_size=block_size, report=True,
                                             example_input=x)
        row.seconds = time.perf_counter() - start
        layers = wl.whitening_layers(model)
        row.converted = len(report.converted)
        row.grouped = sum(1 for _, m in layers if m.groups > 1)
        row.unsupported = report.unsupported
        if row.converted == 0:
            row.check_seconds = time.perf_counter() - t0
            return row
        with torch.no_grad():
            row.conversion_diff = _rel(_logits(model(x)), ref)
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
        finite = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uncalled layers are recorded below
            for step in range(steps):
                xb = torch.randn(shape, generator=g).to(device)
                out = _logits(model(xb))
                if out.dim() == 2:
                    loss = F.cross_entropy(out, torch.randint(0, out.shape[1], (out.shape[0],), generator=g).to(device))
                else:
                    loss = out.float().square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                finite &= bool(torch.isfinite(loss))
        finite &= all(bool(torch.isfinite(p).all()) for p in model.parameters())
        row.finite = finite
        row.uncalled = [n for n, m in layers if int(m.num_blocks) == 0 and m.batches_in_block == 0]
        del opt, layers
        model.eval()
        with torch.no_grad():
            converted_out = _logits(model(x))
            exported = wl.to_plain_model(model)  # in place: the converted model is not needed afterwards
            row.export_diff = _rel(_logits(exported(x)), converted_out)
    except Exception as exc:  # a model that fails is a row of the table, not the end of the run
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        traceback.print_exc()
    row.check_seconds = time.perf_counter() - t0
    return row


def _rss_gb(pid: int) -> float:
    """Resident memory of a process in GB (0 where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _child(conn, name: str, build: Callable[[], nn.Module], shape: Tuple[int, ...],
           pairs: List[Tuple[str, str]], device: str) -> None:
    for method, targets in pairs:
        conn.send(("start", method, targets))
        row = check(name, build, shape, method, targets, device=device)
        conn.send(("row", dataclasses.asdict(row)))
    conn.send(("done",))
    conn.close()


def check_isolated(name: str, build: Callable[[], nn.Module], shape: Tuple[int, ...], pairs: List[Tuple[str, str]],
                   *, device: str = "cpu", timeout: float = 600.0, max_memory_gb: float = 10.0) -> Iterator[Row]:
    """The checks of one model, each in a forked process that is ended when it runs past ``timeout`` seconds or
    ``max_memory_gb`` of resident memory: that check is then a ``not run`` row (the limit named)."""
    ctx = multiprocessing.get_context("fork")
    pending = list(pairs)
    while pending:
        recv, send = ctx.Pipe(duplex=False)
        # one check per process: memory a check freed is not always given back to the system, and would count
        # against the next check's limit
        proc = ctx.Process(target=_child, args=(send, name, build, shape, pending[:1], device), daemon=True)
        proc.start()
        send.close()
        current: Optional[Tuple[str, str]] = None
        started = time.monotonic()
        reason = ""
        while True:
            try:
                if recv.poll(0.25):
                    msg = recv.recv()
                    if msg[0] == "start":
                        current, started = (msg[1], msg[2]), time.monotonic()
                    elif msg[0] == "row":
                        row = Row(**msg[1])
                        pending.remove((row.method, row.targets))
                        current = None
                        yield row
                    else:
                        break
                    continue
            except EOFError:
                reason = f"the process died (exit code {proc.exitcode})"
                break
            if not proc.is_alive() and not recv.poll(0):
                reason = f"the process died (exit code {proc.exitcode})"
                break
            if _rss_gb(proc.pid) > max_memory_gb:
                reason = f"over the {max_memory_gb:g} GB memory limit"
            elif current is not None and time.monotonic() - started > timeout:
                reason = f"over the {timeout:.0f} s time limit"
            if reason:
                break
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
        if not reason:
            continue
        current = current or pending[0]  # (died before it said which check it started)
        pending.remove(current)
        yield Row(name, current[0], current[1], not_run=reason, check_seconds=time.monotonic() - started)


# --------------------------------------------------------------------------
# Model sources
# --------------------------------------------------------------------------
Source = List[Tuple[str, Callable[[], nn.Module], Tuple[int, ...]]]


def self_test_models() -> Source:
    """The stand-ins of :mod:`whitenlayers.models` (the families of the issue), small enough for CI."""
    m = wl.models
    return [
        ("cifar_resnet20", lambda: m.resnet20(width=8), (4, 3, 16, 16)),
        ("mobilenet_like", lambda: stand_ins.mobilenet_like(width=8), (4, 3, 32, 32)),
        ("resnext_like (ResNeXt-50 layout)", lambda: stand_ins.resnext_like((3, 4, 6, 3), width=4), (4, 3, 32, 32)),
        ("vit_like (nn.Linear attention)", lambda: stand_ins.vit_like(), (4, 3, 16, 16)),
        ("vit_like (nn.MultiheadAttention)", lambda: stand_ins.vit_like(attention="mha"), (4, 3, 16, 16)),
        ("hf_resnet_like (HF ResNet-50 layout)", lambda: stand_ins.hf_resnet_like((3, 4, 6, 3)), (4, 3, 32, 32)),
    ]


def torchvision_models(size: int, batch: int, only: Optional[Sequence[str]]) -> Optional[Source]:
    try:
        import torchvision
    except ImportError:
        return None
    names = torchvision.models.list_models(module=torchvision.models)
    if only:
        names = [n for n in names if n in only]
    out: Source = []
    for n in names:
        s = TORCHVISION_SIZES.get(n, size)
        out.append((n, (lambda n=n: torchvision.models.get_model(n, weights=None)), (batch, 3, s, s)))
    return out


def hf_models(batch: int, size: int, only: Optional[Sequence[str]]) -> Optional[Source]:
    """Hugging Face transformers' ``ResNetForImageClassification``: ResNet-50 (the default ``ResNetConfig``) and
    ResNet-18 (``layer_type="basic"``), untrained."""
    try:
        from transformers import ResNetConfig, ResNetForImageClassification
    except ImportError:
        return None
    configs = {
        "hf ResNetForImageClassification (ResNet-50, default ResNetConfig)": {},
        "hf ResNetForImageClassification (ResNet-18, layer_type='basic')": dict(
            depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], layer_type="basic"),
    }
    out: Source = []
    for name, kw in configs.items():
        if only and name not in only and "hf" not in only:
            continue
        out.append((name, (lambda kw=kw: ResNetForImageClassification(ResNetConfig(**kw))), (batch, 3, size, size)))
    return out


def _timm_param_count(timm, name: str) -> float:
    """Parameters of a timm model, built on the meta device (no memory, no weights); inf where it fails."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(sum(p.numel() for p in timm.create_model(name, pretrained=False).parameters()))
    except Exception:
        return math.inf


def timm_models(batch: int, only: Optional[Sequence[str]], cache: Optional[Path] = None) -> Optional[Source]:
    """The smallest model (fewest parameters) of each ``timm.list_modules()`` module, at its default input size.

    The choice (a few minutes of meta-device builds) is kept in ``cache`` (JSON) when given."""
    try:
        import timm
    except ImportError:
        return None
    chosen: Dict[str, str] = {}
    key = f"timm {timm.__version__}"
    if cache is not None and cache.exists():
        chosen = json.loads(cache.read_text()).get(key, {})
    out: Source = []
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        if only:
            names = [n for n in names if n in only or f"{module}: {n}" in only]
        if not names:
            continue
        if not only and chosen.get(module) in names:
            n = chosen[module]
        else:
            n = min(sorted(names), key=lambda n: _timm_param_count(timm, n)) if len(names) > 1 else names[0]
            if not only:
                chosen[module] = n

        def build(n=n):
            return timm.create_model(n, pretrained=False)

        try:
            cfg = timm.get_pretrained_cfg(n)
            size = tuple(cfg.input_size) if cfg is not None else (3, 224, 224)
        except Exception:
            size = (3, 224, 224)
        out.append((f"{module}: {n}", build, (batch,) + tuple(size)))
    if cache is not None and not only:
        cache.write_text(json.dumps({key: chosen}, indent=1, sort_keys=True) + "\n")
    return out


# --------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------
def _fmt(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1e}"


def table(rows: List[Row]) -> List[str]:
    lines = ["| model | method | targets | converted (grouped) | left out, unsupported | max rel. diff at conversion "
             "| 3 steps finite | layers called | export max rel. diff | convert time | check time | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unsupported = "-" if not r.unsupported else f"{len(r.unsupported)}: " + "; ".join(
            sorted({v.split(":")[0] for v in r.unsupported.values()}))
        called = "-" if r.converted == 0 or r.error else ("all" if not r.uncalled else f"{len(r.uncalled)} not")
        finite = "-" if r.converted == 0 or r.error else ("yes" if r.finite else "NO")
        secs = "-" if math.isnan(r.seconds) else f"{1000 * r.seconds:.0f} ms"
        total = "-" if math.isnan(r.check_seconds) else f"{r.check_seconds:.1f} s"
        lines.append(f"| {r.model} | {r.method} | {r.targets} | {r.converted} ({r.grouped}) | {unsupported} | "
                     f"{_fmt(r.conversion_diff)} | {finite} | {called} | {_fmt(r.export_diff)} | {secs} | {total} | {r.status} |")
    return lines


METHOD_ORDER = ("grad", "recursive", "direct")


def totals(rows: List[Row]) -> List[str]:
    """Per target option: models ok with each method and with every method, and what did not run or convert."""
    out = []
    for targets in TARGETS:
        sel = [r for r in rows if r.targets == targets]
        if not sel:
            continue
        models = list(dict.fromkeys(r.model for r in sel))
        methods = [m for m in METHOD_ORDER if any(r.method == m for r in sel)]
        per = []
        for method in methods:
            mr = [r for r in sel if r.method == method]
            ok = sum(1 for r in mr if r.ok and r.converted > 0)
            none = sum(1 for r in mr if r.ok and r.converted == 0)
            not_run = sum(1 for r in mr if r.not_run)
            failed = len(mr) - ok - none - not_run
            text = f"{method} {ok} of {len(mr)}"
            extra = [f"{n} {what}" for n, what in ((none, "nothing to convert"), (not_run, "not run"),
                                                    (failed, "FAILED")) if n]
            per.append(text + (f" ({', '.join(extra)})" if extra else ""))
        every = [m for m in models if all(r.ok and r.converted > 0 for r in sel if r.model == m)
                 and {r.method for r in sel if r.model == m} >= set(methods)]
        out.append(f"- `targets={targets!r}`: converted, trained and exported exactly: " + "; ".join(per)
                   + f"; with every method: {len(every)} of {len(models)} models")
    return out


def _cpu() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for mod in ("torchvision", "timm", "transformers"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            out.append(f"{mod} not installed")
    return ", ".join(out)


def write(path: Path, sections: List[Tuple[str, Optional[List[Row]], str]], argv: List[str],
          commits: Sequence[str] = (), notes: Sequence[str] = ()) -> None:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    counts = {c: list(commits).count(c) for c in dict.fromkeys(commits)}
    commit = ((git_state() or "unknown") if not counts else next(iter(counts)) if len(counts) == 1
              else ", ".join(f"{c} ({n} rows)" for c, n in counts.items()))
    lines = [
        "# Coverage: which models convert, train and export",
        "",
        f"Generated by `python docs/coverage.py {' '.join(argv)}` on {when}; do not edit by hand. "
        f"Code: whitenlayers commit {commit}. {_versions()}; CPU: {_cpu()} ({platform.machine()}), "
        f"{torch.get_num_threads()} torch thread(s).",
        "",
        "Per model, method and targets (`blocks`: the default, convolutions inside residual blocks; `all`: "
        "`targets=\"all\"`, every conv and linear layer but the stem and the classifier; both with "
        "`example_input`): layers converted "
        "(grouped or depthwise among them), layers the rule selected that cannot be converted (reason), the max "
        "relative difference of the eval outputs right after conversion, three SGD steps (`block_size=2`: one "
        "fold) finite, every converted layer called, the max relative difference of `to_plain_model` against the "
        "converted model, the conversion time (with the `example_input` forward; the first model's includes "
        "PyTorch's warm-up) and the time of the whole check (build, conversion, steps with one fold, export; "
        "`-` for rows of runs that did not record it). `ok`: conversion difference <= 1e-5, finite, all called, "
        "export difference <= 1e-4. `nothing converted`: the model has no layer the option selects (e.g. no "
        "residual block). `not run`: the check ran past this machine's time or memory limit (`--timeout`, "
        "`--max-memory-gb`): not a failure of the model, but not covered either.",
        "",
    ]
    if notes:
        lines += ["## Notes", ""] + list(notes) + [""]
    for title, rows, note in sections:
        lines += [f"## {title}", ""]
        if note:
            lines += [note, ""]
        if rows:
            lines += totals(rows) + [""] + table(rows) + [""]
    path.write_text("\n".join(lines))


def _order(rows: List[Row], names: Sequence[str]) -> List[Row]:
    rank = {n: i for i, n in enumerate(names)}
    key = lambda r: (rank.get(r.model, len(rank)), METHOD_ORDER.index(r.method) if r.method in METHOD_ORDER else 9,
                     TARGETS.index(r.targets))
    return sorted(rows, key=key)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "COVERAGE.md")
    p.add_argument("--self-test", action="store_true", help="also check the stand-ins of whitenlayers.models")
    p.add_argument("--quick", action="store_true", help="method grad only (with --self-test: a smoke run)")
    p.add_argument("--methods", default="grad,recursive,direct")
    p.add_argument("--models", default="",
                   help="comma-separated torchvision / timm model names, run in this order (default: all)")
    p.add_argument("--size", type=int, default=64, help="input size of torchvision models without a fixed one")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-torchvision", action="store_true")
    p.add_argument("--no-timm", action="store_true")
    p.add_argument("--no-hf", action="store_true", help="leave out Hugging Face transformers' ResNets")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--isolate", action="store_true",
                   help="each torchvision / timm model in a forked process, with --timeout and --max-memory-gb")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per check with --isolate")
    p.add_argument("--max-memory-gb", type=float, default=10.0, help="resident memory per process with --isolate")
    p.add_argument("--rows", type=Path, default=None,
                   help="JSON-lines file: rows are appended as they finish, and the document is written from every "
                        "row in it (so that runs of different methods or models add up)")
    p.add_argument("--resume", action="store_true", help="with --rows: skip the checks that have a row there")
    p.add_argument("--retry", action="store_true", help="with --resume: run again the checks that failed or did "
                                                         "not run")
    p.add_argument("--note", action="append", default=[], help="a note for the document (repeatable)")
    p.add_argument("--notes", type=Path, default=ROOT / "docs" / "coverage_notes.md",
                   help="hand-written notes put into the document's Notes section (markdown; default: "
                        "docs/coverage_notes.md where it exists)")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds for the whole run: checks not started by then are not run (with --resume: left "
                        "to the rows already there)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = ["grad"] if args.quick else [m for m in args.methods.split(",") if m]
    only = [m for m in args.models.split(",") if m] or None
    saved: List[Row] = []
    row_commit: Dict[Tuple[str, str, str], str] = {}
    if args.rows is not None and args.rows.exists():
        latest: Dict[Tuple[str, str, str], Tuple[Row, str]] = {}
        for line in args.rows.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                c = d.pop("commit", "unknown")
                row = Row(**d)
                latest[(row.model, row.method, row.targets)] = (row, c)  # a later row of a check replaces it
        saved = [r for r, _ in latest.values()]
        row_commit = {k: c for k, (_, c) in latest.items()}
    commit = git_state() or "unknown"

    run_start = time.monotonic()

    def run(source: Source, methods: Sequence[str], isolate: bool) -> List[Row]:
        rows = []
        if only:  # in the order given
            rank = {n: i for i, n in enumerate(only)}
            source = sorted(source, key=lambda s: rank.get(s[0], rank.get(s[0].split(": ")[-1], len(rank))))
        for name, build, shape in source:
            done = {(r.method, r.targets) for r in saved if r.model == name
                    and not (args.retry and (r.not_run or r.error))} if args.resume else set()
            pairs = [(m, t) for m in methods for t in TARGETS if (m, t) not in done]
            if not pairs:
                continue
            over = bool(args.budget) and time.monotonic() - run_start > args.budget
            if over:  # in the document, not in --rows (a later --resume runs them)
                it = iter([Row(name, m, t, not_run="not reached: the run's time budget (--budget) was spent")
                           for m, t in pairs])
            elif isolate:
                it = check_isolated(name, build, shape, pairs, device=args.device, timeout=args.timeout,
                                    max_memory_gb=args.max_memory_gb)
            else:
                it = (check(name, build, shape, m, t, device=args.device) for m, t in pairs)
            for row in it:
                print(f"{name:40s} {row.method:9s} {row.targets:6s} {row.converted:4d}  "
                      f"{row.seconds:7.1f}s {row.check_seconds:7.1f}s  {row.status}", flush=True)
                rows.append(row)
                if args.rows is not None and not over:
                    with open(args.rows, "a") as f:
                        f.write(json.dumps(dict(dataclasses.asdict(row), commit=commit)) + "\n")
                if not over:
                    row_commit[(row.model, row.method, row.targets)] = commit
        return rows

    def section_rows(source: Source, new: List[Row]) -> List[Row]:
        names = [n for n, _, _ in source]
        fresh = {(r.model, r.method, r.targets) for r in new}
        old = [r for r in saved if r.model in names and (r.model, r.method, r.targets) not in fresh]
        return _order(old + new, names)

    sections = []
    failed = False

    def add(title: str, src, isolate: bool, pending: str, describe) -> None:
        """One table from the models of ``src``, or a note that it is pending (``src`` is ``None``)."""
        nonlocal failed
        if src is None:
            print(pending)
            sections.append((title, None, pending))
            return
        rows = section_rows(src, run(src, methods, isolate))
        failed |= any(not r.ok for r in rows)
        heading, text = describe(src)
        sections.append((heading, rows, text))

    if args.self_test:
        add("Stand-ins", self_test_models(), False, "",
            lambda src: ("Stand-ins (whitenlayers.models; no third-party package needed)",
                         "Small models with the structure and class names of MobileNetV2, ResNeXt-50, a ViT (timm's "
                         "`nn.Linear` attention and torchvision's `nn.MultiheadAttention`) and Hugging Face's "
                         "ResNet-50; tested in CI by `tests/test_families.py`."))
    add("torchvision classification models",
        None if args.no_torchvision else torchvision_models(args.size, args.batch, only), args.isolate,
        "torchvision is not installed here (or --no-torchvision): the torchvision table is **pending a "
        "machine with torchvision** (`pip install torchvision`, then `python docs/coverage.py`).",
        lambda tv: ("torchvision classification models",
                    f"`torchvision.models.list_models(module=torchvision.models)` ({len(tv)} builders), "
                    f"untrained, batch {args.batch}, {args.size}x{args.size} inputs except {TORCHVISION_SIZES}."))
    add("Hugging Face transformers", None if args.no_hf else hf_models(args.batch, args.size, only), args.isolate,
        "transformers is not installed here (or --no-hf): the Hugging Face table is pending.",
        lambda hf: ("Hugging Face transformers",
                    f"`transformers.ResNetForImageClassification`, untrained, batch {args.batch}, "
                    f"{args.size}x{args.size} inputs."))
    add("timm families",
        None if args.no_timm else timm_models(args.batch, only,
                                              None if args.rows is None else args.rows.with_suffix(".timm.json")),
        args.isolate, "timm is not installed here (or --no-timm): the timm table is pending.",
        lambda tm: ("timm families (smallest model of each timm module)",
                    f"The model with the fewest parameters of each of the {len(tm)} modules of "
                    f"`timm.list_modules()`, untrained, batch {args.batch}, at its default input size "
                    "(`timm.get_pretrained_cfg(name).input_size`)."))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    commits = [row_commit[k] for _, rows, _ in sections for r in rows or ()  # rows that ran (not `not reached`)
               if (k := (r.model, r.method, r.targets)) in row_commit]
    notes = (args.notes.read_text().strip().splitlines() if args.notes.exists() else []) + [f"- {n}" for n in args.note]
    write(args.out, sections, argv, commits=commits, notes=notes)
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
