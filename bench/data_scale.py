"""Time and peak memory of preparing 10k, 100k and 1M generated conversations into the data cache.

Writes N chat conversations (demo generator, a few turns each) to a jsonl file, then prepares them in a child
process exactly as `shardtune train` does (datasets reads the jsonl into Arrow, `--dataset_num_proc` processes
tokenize with the chatml template into part files, the parent concatenates them into the memory-mapped cache and
packs best-fit). A sampler reads /proc/<pid>/status of the child and all its descendants every 50 ms and records the
peak of the summed VmRSS and of the summed RssAnon (and the main process's own RssAnon). RssAnon is the memory the processes own (heap, arrays);
VmRSS also counts pages of memory-mapped files (the Arrow table, the cache being written), which are page cache
the kernel drops under pressure. Bounded preparation means RssAnon does not grow with the tokens.
Prints a table and writes bench/results/data_scale.json.

    python bench/data_scale.py [--sizes 10000,100000,1000000] [--num_proc 2] [--workdir /tmp/data_scale]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data_scale.json"

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from transformers import AutoTokenizer
from shardtune.data import build_datasets, setup_tokenizer
tok = AutoTokenizer.from_pretrained(args["tokenizer"])
setup_tokenizer(tok, "chatml")
t0 = time.time()
from shardtune.config.arguments import DataArguments
data = DataArguments(dataset_name=args["data"], splits="train", max_length=1024, packing=True,
                     dataset_num_proc=args["num_proc"])
train, _ = build_datasets(data, tokenizer=tok, seed=0, cache_dir=args["cache"], chat_template_format="chatml")
print(json.dumps({"seconds": time.time() - t0, **train.stats}))
"""


def write_conversations(path: Path, n: int, seed: int = 0) -> None:
    from shardtune.commands.demo import _conversation

    rng = random.Random(seed)
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": _conversation(rng)}) + "\n" for _ in range(n))


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def sample_peaks(proc: subprocess.Popen, peaks: dict, interval: float = 0.05) -> None:
    while proc.poll() is None:
        rss = anon = 0
        for p in _tree(proc.pid):
            try:
                s = _status(p)
            except OSError:  # exited between the listing and the read
                continue
            rss, anon = rss + s.get("VmRSS", 0), anon + s.get("RssAnon", 0)
            if p == proc.pid:
                peaks["main_anon"] = max(peaks["main_anon"], s.get("RssAnon", 0))
        peaks["rss"], peaks["anon"] = max(peaks["rss"], rss), max(peaks["anon"], anon)
        time.sleep(interval)


def prepare(data: Path, tokenizer: Path, cache: Path, num_proc: int, workdir: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(workdir / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    args = {"data": str(data), "tokenizer": str(tokenizer), "cache": str(cache), "num_proc": num_proc}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], env=env, stdout=subprocess.PIPE, text=True)
    peaks = {"rss": 0, "anon": 0, "main_anon": 0}
    sampler = threading.Thread(target=sample_peaks, args=(proc, peaks))
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"preparing {data} failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    return {
        **result,
        "wall_s": time.time() - t0,
        "peak_rss": peaks["rss"],
        "peak_anon": peaks["anon"],
        "peak_main_anon": peaks["main_anon"],
        "cache_bytes": cache_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--num_proc", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/data_scale")
    a = ap.parse_args()
    from shardtune.commands.demo import build_tokenizer

    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build_tokenizer(work / "tok", vocab_size=1024)
    rows = []
    print(
        f"{'conversations':>13} {'tokens':>11} {'seconds':>8} {'us/conv':>8} {'peak RSS MiB':>12} "
        f"{'peak anon MiB':>13} {'main anon MiB':>13} {'cache MiB':>9}"
    )
    for n in (int(s) for s in a.sizes.split(",")):
        data = work / f"conv{n}.jsonl"
        write_conversations(data, n)
        r = prepare(data, work / "tok", work / f"cache{n}", a.num_proc, work)
        r["conversations"] = n
        rows.append(r)
        print(
            f"{n:>13} {r['tokens']:>11} {r['seconds']:>8.1f} {1e6 * r['seconds'] / n:>8.0f} "
            f"{r['peak_rss'] / 2**20:>12.0f} {r['peak_anon'] / 2**20:>13.0f} {r['peak_main_anon'] / 2**20:>13.0f} "
            f"{r['cache_bytes'] / 2**20:>9.0f}",
            flush=True,
        )
        shutil.rmtree(work / "hf", ignore_errors=True)
        shutil.rmtree(work / f"cache{n}", ignore_errors=True)
        data.unlink()
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "num_proc": a.num_proc,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    print(f"{info}\nwritten to {RESULTS}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
