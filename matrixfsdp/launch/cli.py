"""``matrixfsdp`` console script: ``train``, ``compare``, ``plan``, ``inspect``.

Imports stay lazy so ``matrixfsdp plan`` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["config_overrides", "main"]

_TORCHRUN_PASSTHROUGH = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id",
                         "--rdzv-backend", "--max-restarts", "--master-addr", "--master-port")
_SINGLE_NODE_OK = {"tr_max_restarts"}  # passthrough flags that keep torchrun's --standalone


def _override_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--optimizer", choices=["muon", "shampoo", "soap", "okls", "emagram", "adamw"])
    p.add_argument("--steps", type=int)
    p.add_argument("--nproc", type=int, help="ranks on this node (default: 2)")
    p.add_argument("--out", help="output directory (default: runs/default)")
    p.add_argument("--replicate", type=int, help="HSDP: replicas (e.g. nodes); ranks = "
                   "replicate x shard size; default 1 = flat owner sharding over all ranks")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per data-parallel rank "
                   "(innermost; ranks = replicate x shard x tp); default 1 = no TP")
    p.add_argument("--skip-nonfinite", action=argparse.BooleanOptionalAction, default=None,
                   help="skip steps whose global gradient norm is inf/NaN (default: on)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set lr=0.01 --set model.dim=256")
    return p


def config_overrides(argv: list[str], prog: str = "matrixfsdp train") -> dict[str, Any]:
    """Flags (and ``--set key=value`` pairs) to ``load_config`` keyword overrides."""
    import yaml

    args, unknown = _override_parser().parse_known_args(argv)
    if unknown:
        raise SystemExit(f"{prog}: unrecognized arguments: {' '.join(unknown)}")
    overrides: dict[str, Any] = {"optimizer": args.optimizer, "steps": args.steps,
                                 "nproc": args.nproc, "out": args.out,
                                 "replicate": args.replicate, "tp": args.tp,
                                 "skip_nonfinite": args.skip_nonfinite}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _parse_value(value, yaml)
    return overrides


_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _parse_value(text: str, yaml: Any) -> Any:
    """A ``--set`` value as YAML reads it, except that ``1e-12`` is a number, not a string.

    YAML 1.1 (PyYAML) reads an exponent without a dot or without a sign (``1e-12``, ``3E5``,
    ``1.0e5``) as a string, which would reach an optimizer's config as ``'1e-12'``. Items of a
    list (``[0.9, 1e-3]``) are read the same way.
    """
    return _exponents_as_numbers(yaml.safe_load(text))


def _exponents_as_numbers(value: Any) -> Any:
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_exponents_as_numbers(v) for v in value]
    return value


def _cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from . import faults
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, **config_overrides(rest))  # fails before any process
        out = Path(cfg.out)
        faults.resolve_start(out, resume=args.resume, overwrite=args.overwrite, restarts=0)
    except (ConfigError, ValueError) as exc:  # bad config; checkpoints there and no flag
        print(f"matrixfsdp train: {exc}", file=sys.stderr)
        return 2
    if args.tr_nnodes is None and cfg.nproc % cfg.replicate:  # one node: the world is known
        print(f"matrixfsdp train: --replicate {cfg.replicate} does not divide the {cfg.nproc} "
              f"ranks (ranks = replicate x shard size); choose a divisor of {cfg.nproc}",
              file=sys.stderr)
        return 2
    if args.tr_nnodes is None and cfg.nproc % (cfg.replicate * cfg.tp):
        print(f"matrixfsdp train: --replicate {cfg.replicate} x --tp {cfg.tp} does not divide "
              f"the {cfg.nproc} ranks (ranks = replicate x shard size x tp); choose divisors of "
              f"{cfg.nproc}", file=sys.stderr)
        return 2
    if args.overwrite:
        faults.move_aside(out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / "config.json"
    resolved.write_text(cfg.model_dump_json(indent=2) + "\n")
    if args.device != "auto":
        os.environ["MATRIXFSDP_DEVICE"] = args.device
    # A fresh worker store per restart (see [Note: restarts] in faults.py).
    os.environ.setdefault(faults.SHARE_STORE_ENV, "1")
    given = {flag: value for flag, value in vars(args).items()
             if flag.startswith("tr_") and value is not None}
    rdzv = [x for flag, value in given.items() for x in (f"--{flag[3:].replace('_', '-')}", str(value))]
    standalone = [] if set(given) - _SINGLE_NODE_OK else ["--standalone"]
    torchrun = ["--nproc-per-node", str(cfg.nproc), *standalone, *rdzv,
                "-m", "matrixfsdp.launch.train", "--config", str(resolved)]
    if args.resume:
        torchrun.append("--resume")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(torchrun))
    except ChildFailedError as exc:
        print(f"matrixfsdp train: a rank failed ({exc.name}); see the log above. Rerun with "
              "--resume to continue from the latest checkpoint.", file=sys.stderr)
        return 1
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan_cmd import format_plan, plan_for_model

    cap = int(args.memory_cap_gib * 1024**3) if args.memory_cap_gib else None
    try:
        plan = plan_for_model(args.model, args.world_size, args.optimizer, cap,
                              replicate=args.replicate, tp=args.tp)
    except ValueError as exc:
        print(f"matrixfsdp plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json(indent=2))
    else:
        mesh = "" if args.replicate == 1 else (
            f" = {args.replicate} replicas x {plan.world_size} (HSDP; ranks below: one replica)")
        if args.tp > 1:
            mesh = (f" = {args.replicate} replicas x {plan.world_size} dp ranks x {args.tp} tp "
                    "ranks (ranks below: the dp ranks of one replica; each holds its matrices' "
                    f"TP shards, 1/{args.tp} of the bytes below per GPU)")
        print(format_plan(plan, title=f"owner plan for {args.model} on {args.world_size} ranks"
                                      f"{mesh} (cost: {args.optimizer})"))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect_cmd import inspect_checkpoint

    try:
        print(inspect_checkpoint(args.checkpoint))
    except (ValueError, FileNotFoundError) as exc:
        print(f"matrixfsdp inspect: {exc}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="matrixfsdp", description=(
        "Owner-shaped ZeRO-3 sharding for matrix optimizers on PyTorch FSDP2."))
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the embedded byte-level GPT (or your config)",
                           parents=[_override_parser()])
    train.add_argument("--config", help="YAML or JSON file of TrainConfig fields")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in OUT (torchrun restarts always do)")
    train.add_argument("--overwrite", action="store_true",
                       help="move an existing run in OUT aside (OUT.old-<time>) and start over")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    for flag in _TORCHRUN_PASSTHROUGH:
        train.add_argument(flag, dest="tr_" + flag[2:].replace("-", "_"),
                           help="passed to torchrun (multi-node rendezvous)")
    compare = sub.add_parser(
        "compare", help="train several optimizers with their defaults on one task; plot and tabulate",
        description="Each optimizer trains with its recommended defaults on the same data order, "
                    "seed and global batch, in OUT/<optimizer>; then OUT/compare.png and "
                    "OUT/compare.md compare them. Run the same command again to resume. Takes "
                    "train's --steps, --nproc, --out (default runs/compare) and --set KEY=VALUE.")
    compare.add_argument("--optimizers", default="muon,okls,soap,shampoo,emagram,adamw",
                         help="comma-separated names (default: all six)")
    compare.add_argument("--config", help="YAML or JSON file of shared TrainConfig fields")
    compare.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    plan = sub.add_parser("plan", help="print the owner plan of a model (no process group)")
    plan.add_argument("--model", default="llama3-8b",
                      help="preset (llama3-8b, llama3-70b, llama2-7b, gpt-small) or module:factory")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--optimizer", default="muon",
                      choices=["muon", "shampoo", "soap", "okls", "emagram", "adamw"])
    plan.add_argument("--replicate", type=int, default=1,
                      help="HSDP replicas: plan over world-size / replicate ranks per replica")
    plan.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel ranks (innermost): plan over world-size / (replicate "
                      "x tp) dp ranks; the TP shards of each matrix live on its owner's tp ranks")
    plan.add_argument("--memory-cap-gib", type=float, help="max matrix GiB per rank")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    inspect = sub.add_parser("inspect", help="print a checkpoint's layout, step and sizes")
    inspect.add_argument("checkpoint")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        # Config overrides travel as raw flags; launcher-only flags are dropped first.
        return _cmd_train(args, _strip_train_only(argv[1:]))
    if args.command == "compare":
        from .compare import run_cli

        if args.device != "auto":
            os.environ["MATRIXFSDP_DEVICE"] = args.device
        return run_cli(args.config, args.optimizers, rest, "matrixfsdp " + " ".join(argv))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "plan":
        return _cmd_plan(args)
    return _cmd_inspect(args)


def _strip_train_only(argv: list[str]) -> list[str]:
    """Drop flags that belong to the launcher, keeping config overrides."""
    out, skip = [], False
    launcher = {"--config", "--device", *_TORCHRUN_PASSTHROUGH}
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if arg in ("--resume", "--overwrite"):
            continue
        if name in launcher:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
