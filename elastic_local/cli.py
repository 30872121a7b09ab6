"""The `elastic-local` command: a thin layer over the library; every subcommand is a few lines."""

from __future__ import annotations

import argparse
import json
import sys


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def cmd_info(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import describe

    d = describe(args.dir)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"{d['path']}: Nemotron-H, {len(d['pattern'])} layers "
          + ", ".join(f"{n} {kind}" for kind, n in d["layers"].items()))
    print(f"  pattern   {d['pattern']}")
    c = d["config"]
    print(f"  hidden    {c['hidden_size']}, vocab {c['vocab_size']}")
    print(f"  params    {_count(d['params'])} total, {_count(d['active_params'])} active per token")
    w = d["weights"]
    if w is None:
        print(f"  weights   none ({d['weights_note']})")
    else:
        dtypes = ", ".join(f"{k} {_gib(v)}" for k, v in w["tensor_bytes_by_dtype"].items())
        print(f"  on disk   {_gib(w['bytes_on_disk'])} in {w['files']} file(s) ({dtypes})")
    print("  budgets")
    for b in d["budgets"]:
        print(f"    {b['name']:<8} {_count(b['params']):>8} params, {_count(b['active_params']):>8} active")
    k = d["kernels"]
    print(f"  kernels   on {k['device']}: scan {k['mamba_scan']}, conv {k['mamba_conv']}")
    if "note" in k:
        print(f"            {k['note']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-local", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="describe a checkpoint directory")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_info)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"elastic-local: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
