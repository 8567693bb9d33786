"""``policy_lag_split``'s memory per kept version on 2 CPU ranks: DeepSpeed ZeRO-3 and FSDP2 (each version kept as
the rank's own shards, ``version_store.RankShards``) against 1 rank (a whole copy, ``FullCopies``).

Runs ``tests/helpers/dist_sharded_worker.py`` (the tiny Llama, parameters really sharded, stale rows on rank 0 only, 3
steps) with the ``policy_lag_split`` case under torchrun and prints a Markdown table: per backend and rank the bytes
held per kept version at the end of training, the rank's live shard bytes and the full parameters' bytes. About 2
minutes on 2 cores::

    PYTHONPATH=$PWD python benchmarks/lag_split_shard_memory.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "helpers")


def launch(nproc: int, backend: str, out_dir: str, model_dir: str) -> list[dict]:
    """One torchrun launch of the worker's ``policy_lag_split`` case; each rank's result."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(out_dir, f"{backend}{nproc}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           os.path.join(TESTS, "dist_sharded_worker.py"), out, model_dir, backend, "policy_lag_split"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{backend} x{nproc} failed:\n{proc.stderr[-3000:]}")
    return [json.load(open(f"{out}.rank{r}"))["cases"]["policy_lag_split"] for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    sys.path[:0] = [ROOT, TESTS]
    from tiny_model import make_tiny_model_dir

    work = args.out or tempfile.mkdtemp(prefix="lag_split_memory_")
    os.makedirs(work, exist_ok=True)
    model_dir = make_tiny_model_dir(os.path.join(work, "tiny_llama"), "llama", seed=0)
    print("| backend | rank | store | versions held at the end | bytes per version | rank's shard bytes | "
          "full parameters' bytes | per version / full |")
    print("|---|---|---|---|---|---|---|---|")
    for nproc, backend in ((1, "ddp"), (2, "zero3"), (2, "fsdp2")):
        for rank, result in enumerate(launch(nproc, backend, work, model_dir)):
            if "refused" in result:
                raise SystemExit(f"{backend}: refused: {result['refused']}")
            mem = result["lag_split_memory"]
            per = sorted(set(mem["per_version"].values()))
            print(f"| {backend} x{nproc} | {rank} | {mem['store']} | {sorted(int(v) for v in mem['per_version'])} | "
                  f"{', '.join(str(b) for b in per)} | {mem['rank_shard_bytes']} | {mem['full_bytes']} | "
                  f"{max(per) / mem['full_bytes']:.3f} |")


if __name__ == "__main__":
    main()
