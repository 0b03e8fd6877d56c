"""Throughput and memory of `python -m jaxgpt.prepare`, of bare tiktoken, and of the loader.

    python scripts/prepare_bench.py corpus --out DIR --gb 2 [--formats jsonl,parquet] [--slice-mb 200]
    python scripts/prepare_bench.py prepare INPUT --out DIR [--workers N] [prepare flags ...]
    python scripts/prepare_bench.py bare INPUT.jsonl          # encode_ordinary, one thread, same text
    python scripts/prepare_bench.py threads INPUT.jsonl       # tiktoken's encode_ordinary_batch, 1 vs 2 threads
    python scripts/prepare_bench.py old TEXT_FILE --out DIR   # the in-memory single-file prepare
    python scripts/prepare_bench.py loader DIR [DIR ...]      # train_iterator tokens/s per prepared dir
    python scripts/prepare_bench.py verify DIR [--make-gb 1]  # the shard check before training (sha256, ids)

`corpus` builds real text without downloading anything: the bundled tiny shakespeare, the
licenses in /usr/share/common-licenses, the text files (and gzipped ones) under /usr/share/doc and
the docstrings of Python's standard library, cut into paragraphs; documents are 1-30 paragraphs
drawn at random (seeded), written until the size is reached, as JSON Lines (`corpus.jsonl`),
Parquet (`corpus.parquet`) and a JSON Lines slice of the first `--slice-mb` MB (`slice.jsonl`, plus
its text as one file, `slice.txt`, for the old prepare). `prepare`/`old` run the command in a
subprocess and sample the resident memory of its whole process tree (main + workers) every 0.2 s.
`verify --make-gb G` first writes a synthetic prepared dir of G GB (random ids below the vocabulary,
50M-token shards, meta.json with their sha256) into DIR. Every command prints one JSON line.
"""

import argparse
import ast
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def paragraphs() -> list[str]:
    texts = [(REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt").read_text()]
    for root in (Path("/usr/share/common-licenses"), Path("/usr/share/doc")):
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            if not p.is_file() or p.is_symlink() or p.stat().st_size > 20_000_000:
                continue
            try:
                raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
                texts.append(raw.decode("utf-8"))
            except (OSError, UnicodeDecodeError, EOFError):
                continue
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.rglob("*.py")):
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    out = []
    for t in texts:
        if "\x00" in t:
            continue
        out.extend(p.strip("\n") for p in t.replace("\r\n", "\n").split("\n\n") if p.strip())
    return out


def build_corpus(out: Path, gb: float, formats: list[str], slice_mb: float) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    out.mkdir(parents=True, exist_ok=True)
    pool = paragraphs()
    pool_mb = sum(len(p.encode()) for p in pool) / 1e6
    rng = random.Random(0)
    target, slice_bytes = int(gb * 1e9), int(slice_mb * 1e6)
    jsonl = open(out / "corpus.jsonl", "w") if "jsonl" in formats else None
    sl, sl_txt = open(out / "slice.jsonl", "w"), open(out / "slice.txt", "w")
    pw = pq.ParquetWriter(out / "corpus.parquet", pa.schema([("text", pa.string())])) \
        if "parquet" in formats else None
    written, docs, rows = 0, 0, []
    while written < target:
        doc = "\n\n".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        n = len(doc.encode())
        line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
        if jsonl:
            jsonl.write(line)
        if written < slice_bytes:
            sl.write(line)
            sl_txt.write(doc + "\n\n")
        if pw:
            rows.append(doc)
            if len(rows) == 20_000:
                pw.write_table(pa.table({"text": rows}))
                rows = []
        written += n
        docs += 1
    if pw:
        if rows:
            pw.write_table(pa.table({"text": rows}))
        pw.close()
    for f in (jsonl, sl, sl_txt):
        if f:
            f.close()
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return {"paragraph_pool_mb": round(pool_mb, 1), "paragraphs": len(pool), "documents": docs,
            "text_bytes": written, "files": sizes}


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def cpu_seconds(pid: int) -> float:
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_measured(cmd: list[str]) -> tuple[float, int, str, dict]:
    """Wall time, peak tree RSS, output and CPU seconds (the whole tree, and its main process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, main_cpu, stop = [0], [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            try:
                main_cpu[0] = cpu_seconds(proc.pid)
            except (OSError, ValueError, IndexError):
                pass
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.communicate()[0]
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if proc.returncode:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{output}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, peak[0], output, {"tree": tree, "main": main_cpu[0]}


def bench_prepare(args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxgpt.prepare", args.input, "--out", args.out, "--progress", "lines",
           *(["--workers", str(args.workers)] if args.workers else []), *extra]
    wall, peak, output, cpu = run_measured(cmd)
    meta = json.loads((Path(args.out) / "meta.json").read_text())
    tokens = meta["train_tokens"] + meta["val_tokens"]
    mb = meta["text_bytes"] / 1e6
    workers_cpu = cpu["tree"] - cpu["main"]
    return {"command": "prepare", "input": args.input, "workers": args.workers, "wall_s": round(wall, 1),
            "text_mb": round(meta["text_bytes"] / 1e6, 1), "tokens": tokens,
            "mb_per_s": round(meta["text_bytes"] / 1e6 / wall, 2), "tokens_per_s": round(tokens / wall),
            "cpu_s_workers": round(workers_cpu, 1), "cpu_s_main": round(cpu["main"], 1),
            "mb_per_worker_cpu_s": round(mb / max(workers_cpu, 1e-9), 2),
            "mb_per_main_cpu_s": round(mb / max(cpu["main"], 1e-9), 2),
            "peak_rss_mb_tree": round(peak / 1e6), "shards": len(meta["shards"]["train"]) + len(meta["shards"]["val"]),
            "summary": output.strip().splitlines()[-1]}


def bench_bare(args) -> dict:
    from jaxgpt import tokenizer
    enc = tokenizer.gpt2_encoding()
    spent, nbytes, ntok = 0.0, 0, 0
    with open(args.input) as f:
        for line in f:
            text = json.loads(line)["text"]
            t0 = time.process_time()  # CPU time: comparable with the workers' CPU seconds
            ntok += len(enc.encode_ordinary(text))
            spent += time.process_time() - t0
            nbytes += len(text.encode())
    return {"command": "bare encode_ordinary (1 thread)", "input": args.input, "encode_cpu_s": round(spent, 1),
            "mb_per_s": round(nbytes / 1e6 / spent, 2), "tokens_per_s": round(ntok / spent)}


def bench_threads(args) -> dict:
    """tiktoken's own threaded batch encoder (the alternative to worker processes), same text."""
    from jaxgpt import tokenizer
    enc = tokenizer.gpt2_encoding()
    texts, nbytes = [], 0
    with open(args.input) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            nbytes += len(texts[-1].encode())
            if nbytes >= args.mb * 1e6:
                break
    rows = {}
    for n in (1, 2):
        w0, c0 = time.perf_counter(), time.process_time()
        enc.encode_ordinary_batch(texts, num_threads=n)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        rows[f"threads={n}"] = {"mb_per_s": round(nbytes / 1e6 / wall, 2), "cpu_s": round(cpu, 1),
                                "wall_s": round(wall, 1)}
    return {"command": "tiktoken encode_ordinary_batch", "text_mb": round(nbytes / 1e6, 1), **rows}


def bench_old(args) -> dict:
    code = f"from jaxgpt.data import prepare; prepare([{args.input!r}], {args.out!r})"
    wall, peak, _, cpu = run_measured([sys.executable, "-c", code])
    meta = json.loads((Path(args.out) / "meta.json").read_text())
    mb = Path(args.input).stat().st_size / 1e6
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"command": "old prepare (in memory, 1 thread)", "input": args.input, "wall_s": round(wall, 1),
            "text_mb": round(mb, 1), "mb_per_s": round(mb / wall, 2), "tokens_per_s": round(tokens / wall),
            "cpu_s": round(cpu["tree"], 1), "mb_per_cpu_s": round(mb / cpu["tree"], 2), "peak_rss_mb": round(peak / 1e6)}


def bench_loader(args) -> dict:
    from jaxgpt import data
    rows = {}
    for d in args.dirs:
        tokens = data.load_split(Path(d), "train")
        it = data.train_iterator(tokens, seq_len=1024, global_batch=32, seed=0, process_index=0,
                                 process_count=1, prefetch=4, num_threads=2)
        for _ in range(5):
            next(it)
        t0 = time.perf_counter()
        for _ in range(args.batches):
            next(it)
        took = time.perf_counter() - t0
        shards = len(tokens.parts) if isinstance(tokens, data.ShardedTokens) else 1
        rows[d] = {"shards": shards, "tokens_per_s": round(args.batches * 32 * 1024 / took)}
    return {"command": "loader train_iterator (seq 1024, batch 32, 2 threads)", "dirs": rows}


def bench_verify(args) -> dict:
    """integrity.check_dir on DIR: 1 thread, the default threads, then again with a verdict cache."""
    import hashlib
    import tempfile

    import numpy as np

    from jaxgpt import data, tokenizer
    from jaxgpt.data.integrity import check_dir, remember
    d = Path(args.dir)
    if args.make_gb:
        d.mkdir(parents=True, exist_ok=True)
        rng, shards, left = np.random.default_rng(0), {"train": [], "val": []}, int(args.make_gb * 5e8)
        for i, split in enumerate(["val"] + ["train"] * (left // 50_000_000 + 1)):
            n = 1000 if split == "val" else min(50_000_000, left)
            if n <= 0:
                break
            left -= n if split == "train" else 0
            ids = rng.integers(0, tokenizer.N_VOCAB, n, dtype=np.uint16)
            name = f"{split}-{len(shards[split]):05d}.bin"
            ids.tofile(d / name)
            shards[split].append({"file": name, "tokens": n, "sha256": hashlib.sha256(ids.tobytes()).hexdigest()})
        (d / "meta.json").write_text(json.dumps({
            "tokenizer": tokenizer.TOKENIZER_NAME, "tokenizer_sha256": tokenizer.vocab_sha256(),
            "vocab_size": tokenizer.N_VOCAB, "dtype": "uint16", "shards": shards,
            **{f"{s}_tokens": sum(x["tokens"] for x in shards[s]) for s in shards}}))
    meta = data.load_meta(d)
    rows = {}
    for name, threads in (("1 thread", 1), ("default threads", None)):
        t0 = time.perf_counter()
        n = check_dir(d, meta, threads=threads)
        took = time.perf_counter() - t0
        rows[name] = {"gb": round(n / 1e9, 3), "s": round(took, 2), "gb_per_s": round(n / 1e9 / took, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "data-verified.json"
        remember(cache)  # what train.py does once the run dir exists
        t0 = time.perf_counter()
        n = check_dir(d, meta, cache=cache)
        rows["cached verdicts"] = {"bytes_read": n, "s": round(time.perf_counter() - t0, 4)}
    return {"command": "verify (integrity.check_dir: size, sha256, token ids)", "dir": str(d),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], **rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--gb", type=float, default=2.0)
    c.add_argument("--formats", default="jsonl,parquet")
    c.add_argument("--slice-mb", type=float, default=200.0)
    pr = sub.add_parser("prepare")
    pr.add_argument("input")
    pr.add_argument("--out", required=True)
    pr.add_argument("--workers", type=int, default=None)
    b = sub.add_parser("bare")
    b.add_argument("input")
    th = sub.add_parser("threads")
    th.add_argument("input")
    th.add_argument("--mb", type=float, default=50.0)
    o = sub.add_parser("old")
    o.add_argument("input")
    o.add_argument("--out", required=True)
    lo = sub.add_parser("loader")
    lo.add_argument("dirs", nargs="+")
    lo.add_argument("--batches", type=int, default=300)
    v = sub.add_parser("verify")
    v.add_argument("dir")
    v.add_argument("--make-gb", type=float, default=0.0)
    args, extra = p.parse_known_args()
    if args.cmd == "corpus":
        row = {"command": "corpus", **build_corpus(args.out, args.gb, args.formats.split(","), args.slice_mb)}
    elif args.cmd == "prepare":
        row = bench_prepare(args, extra)
    elif args.cmd == "bare":
        row = bench_bare(args)
    elif args.cmd == "threads":
        row = bench_threads(args)
    elif args.cmd == "old":
        row = bench_old(args)
    elif args.cmd == "verify":
        row = bench_verify(args)
    else:
        row = bench_loader(args)
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **row}), flush=True)


if __name__ == "__main__":
    main()
