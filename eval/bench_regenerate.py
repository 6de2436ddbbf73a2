"""Replies per CPU-minute: regeneration in transformers (`generate`, batched) against llama.cpp serving the target's
GGUF file in parallel slots and vLLM's offline batch generation on the target's HF folder, on the same prompts.

    .venv/bin/python eval/bench_regenerate.py --records 64 --slots 8,16

Prompts: the first user turns of the first N train records of the recipe's data (default
recipes/eagle3-smollm2-cpu.yaml: greedy, 128 new tokens, batch 32), regenerated through `data.regenerate` exactly
as the generator does (`regenerate` / `regenerate_llamacpp` / `regenerate_vllm`). Each engine runs once untimed on a
few prompts first (vLLM's engine start-up, timed apart, is left out). CPU time is what the engine used: this
process's user + system time for transformers; the server's (from /proc) plus this process's for llama.cpp; vLLM's
engine process and this process's for vLLM. Reports replies and generated tokens per CPU-minute and per wall minute, and
how often the two engines wrote the same reply (the GGUF is quantized and dequantised for transformers, so greedy
replies fork at near-ties). Prints one JSON line on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from speculators_train.data.chat import Chat
from speculators_train.data.regenerate import regenerate, regenerate_llamacpp, regenerate_vllm
from speculators_train.data.splits import load_splits
from speculators_train.errors import run_script
from speculators_train.origin import gguf_file, resolve_origin
from speculators_train.recipe import load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import load_target

REPO = Path(__file__).resolve().parents[1]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _replies(conversations) -> list[str]:
    return [next((m["content"] for m in c.messages if m["role"] == "assistant"), "") for c in conversations]


def _row(name: str, wall: float, cpu: float, texts: list[str], tokenizer) -> dict[str, Any]:
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return {
        "engine": name,
        "replies": len(texts),
        "tokens": tokens,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "replies_per_cpu_min": round(len(texts) / cpu * 60, 1),
        "replies_per_wall_min": round(len(texts) / wall * 60, 1),
        "tokens_per_cpu_s": round(tokens / cpu, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "recipes/eagle3-smollm2-cpu.yaml"))
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--slots", default="8,16", help="llama.cpp parallel slots to try, comma-separated")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    regen = recipe.data.regenerate.model_copy(update={"enabled": True, "max_turns": 1})
    convs = load_splits(recipe).train[: args.records]
    target = load_target(recipe.target)
    chat, tok = Chat(target.tokenizer, recipe.data.chat_template_kwargs), target.tokenizer
    max_length, seed = recipe.data.max_length, recipe.seed
    gguf = gguf_file(recipe.target)
    if gguf is None:
        parser.error(f"{recipe.target.name_or_path}: not a GGUF target; llama.cpp has nothing to serve")
    rows, texts = [], {}

    regenerate(convs[:4], target.model, chat, regen, max_length, seed)  # warm-up
    with target.packed(recipe.generation.max_tokens_per_batch):  # as the generator regenerates
        cpu, wall = _cpu(), time.perf_counter()
        texts["transformers"] = _replies(regenerate(convs, target.model, chat, regen, max_length, seed))
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu
        rows.append(_row(f"transformers b{regen.batch_size}", wall, cpu, texts["transformers"], tok))

    for slots in [int(s) for s in args.slots.split(",")]:
        cfg = regen.model_copy(update={"batch_size": slots, "engine": "llama.cpp"})
        regenerate_llamacpp(convs[:4], chat, cfg, max_length, seed, gguf)  # warm-up (and first build, if needed)
        cpu, wall = _cpu(), time.perf_counter()
        server_cpu: list[float] = []
        out = regenerate_llamacpp(convs, chat, cfg, max_length, seed, gguf, server_cpu=server_cpu)
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu + sum(server_cpu)
        texts[f"llama.cpp x{slots}"] = _replies(out)
        rows.append(_row(f"llama.cpp x{slots}", wall, cpu, texts[f"llama.cpp x{slots}"], tok))

    if not args.no_vllm:
        import psutil

        from speculators_train.engines.vllm.offline import Engine

        def engine_cpu() -> float:
            times = [c.cpu_times() for c in psutil.Process().children(recursive=True)]
            return _cpu() + sum(t.user + t.system for t in times)

        model = Path(resolve_origin(recipe.target)[0])
        with Engine(model, max_model_len=max_length, seed=seed) as engine:
            regenerate_vllm(convs[:4], chat, regen, max_length, seed, model, engine)  # warm-up
            cpu, wall = engine_cpu(), time.perf_counter()
            out = regenerate_vllm(convs, chat, regen, max_length, seed, model, engine)
            wall, cpu = time.perf_counter() - wall, engine_cpu() - cpu
            texts["vllm"] = _replies(out)
            rows.append(_row("vllm", wall, cpu, texts["vllm"], tok))
            rows[-1]["engine_start_s"] = round(engine.start_seconds, 1)

    base = rows[0]["replies_per_cpu_min"]
    for row in rows:
        row["vs_transformers"] = round(row["replies_per_cpu_min"] / base, 2)
        mine = texts[row["engine"].split(" b")[0] if row["engine"].startswith("transformers") else row["engine"]]
        row["same_reply_as_transformers"] = round(
            sum(a == b for a, b in zip(mine, texts["transformers"], strict=True)) / len(mine), 2
        )
    print(json.dumps({"records": len(convs), "max_new_tokens": regen.max_new_tokens, "rows": rows}), flush=True)
    table = Table(title=f"regeneration of {len(convs)} first turns, up to {regen.max_new_tokens} new tokens, greedy")
    for col in ("engine", "replies", "tokens", "wall_s", "cpu_s", "replies_per_cpu_min", "vs_transformers",
                "same_reply_as_transformers"):  # fmt: skip
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row[c]) for c in (
            "engine", "replies", "tokens", "wall_s", "cpu_s", "replies_per_cpu_min", "vs_transformers",
            "same_reply_as_transformers")))  # fmt: skip
    Console(stderr=True).print(table)


if __name__ == "__main__":
    run_script(main)
