"""``kvledger gpus``: the GPU catalog the planner knows (also ``kvledger plan --gpu list``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gpus", help="list the GPU catalog: device-reported memory, bandwidth, SM, FP8",
                              description="The cards --gpu accepts, with the memory the device reports (GiB), the "
                                          "datasheet bandwidth (TB/s), the architecture and whether FP8 is in hardware. "
                                          "Sources are in kvledger/planner/gpus.json.")
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvledger.planner.gpus import gpus, list_catalog

    if args.json:
        from kvledger.cli.common import print_json

        print_json([asdict(g) for g in gpus().values()])
    else:
        print(list_catalog())
    return 0
