"""The console entry point: ``python -m whitenlayers.experiment`` / ``whitenlayers-experiment``."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from .config import build_parser, resolve_config
from .context import Context
from .engine import run
from .report import replot

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the command line, then train and report (or ``--replot``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot, args.target_acc)
        return 0
    try:
        cfg = resolve_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    ctx = Context(cfg.device, cfg.threads)
    try:
        run(cfg, ctx, argv)
    finally:
        ctx.close()
    return 0
