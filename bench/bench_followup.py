"""Where the time to first token of a follow-up turn in a long chat goes, stage by stage, on the host.

A tiny DeepSeek-V3.2 (3 layers, 64-wide) with DeepSeek-V3.2's vocabulary size (129,280 ids, a
synthetic byte-level BPE whose merges build lowercase words, as ``bench_e2e``'s checkpoints) runs
in-process (``Engine.add_request`` + ``step``) with a chat of ``--context`` tokens in 64-token pages.
The chat's first turns are not computed (the CPU cannot prefill 64K tokens in reasonable time; their
forward is replaced by zero logits and their pages hold zeros): only the follow-ups are timed, as
``bench_e2e --configs chat-cache`` times them, in three cases:

  device    the chat's pages are still in the device cache;
  switch    two other chats of the same length filled the device cache since (pages come from RAM);
  restart   a new engine on the same model and cache folder (the files dropped from the OS file
            cache with ``posix_fadvise`` where the OS has it; the engine's warm start reads the
            newest pages back into RAM while it loads and warms up, so they come from RAM when it
            got there first, else from disk: the restore row's disk share says which).

Each row splits the wall time from the request's arrival to its first token into the stages the
request passes: the server's body parsing (pydantic + the Unicode check, done here without HTTP),
rendering the chat prompt, tokenising, the rest of ``add_request``, prefix matching (hashing the
pages), restoring pages, spilling evicted pages, the forward (the tiny model on the CPU: says
nothing about a GPU), sampling and events (the rest of the step), and the stats snapshot the server
takes before it hands the first token out. Stages are timed by wrapping the engine's own methods.

    python bench/bench_followup.py [--context 65536] [--reps 3] [--dir /tmp/hearth-followup] [--stub-forward]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import string
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hearth.engine.api import EngineConfig, TokenDelta
from hearth.engine.engine import Engine
from hearth.engine.prefix_store import PrefixStore
from hearth.engine.server.protocol import ChatCompletionRequest, check_text
from hearth.engine.text.tokenizer import Tokenizer

BLOCK_SIZE = 64
VOCAB = 129280
ANSWER_TOKENS = 32
FOLLOW_UP_TOKENS = 64

# (stage, object path on the engine, method name): the engine's own methods, wrapped to time them.
STAGES = (
    ("render", "tokenizer", "chat_prompt"),
    ("tokenise", "tokenizer", "encode"),
    ("tokenise", "_prompt_tokens", "encode"),  # a conversation's prompts (only the new text is tokenised)
    ("prefix match", "blocks", "_prefix_hits"),
    ("restore", "prefix_tier", "restore"),
    ("spill", "prefix_tier", "spill"),
    ("forward", "runner", "run"),
    ("stats", "", "stats"),
)


def write_checkpoint(folder: Path) -> Path:
    """A tiny DeepSeek-V3.2 with a 129,280-id synthetic tokenizer (reused when present)."""
    from hearth.engine.testing.tiny import write_tiny_model
    from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer

    stamp = folder / "followup-stamp.json"
    if stamp.exists():
        return folder
    write_tiny_model(folder, "deepseek_v32", seed=0,
                     overrides={"vocab_size": VOCAB, "max_position_embeddings": 1 << 20})
    special = write_tiny_tokenizer(folder, "deepseek_v32", VOCAB, synthetic=True)
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((folder / name).read_text())
        raw.update(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"])
        (folder / name).write_text(json.dumps(raw, indent=2))
    stamp.write_text("{}")
    return folder


def words(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """Random lowercase words of ``tokens`` tokens (as ``bench_e2e``'s prompts)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (tokens,), generator=gen).tolist()
    letters = torch.randint(0, 26, (sum(lengths),), generator=gen).tolist()
    out, at = [], 0
    for length in lengths:
        out.append("".join(string.ascii_lowercase[i] for i in letters[at:at + length]))
        at += length
    return tokenizer.decode(tokenizer.encode(" ".join(out))[:tokens])


class Clock:
    """Wall time per stage, from wrapped methods, until the first token."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.running = True  # False once the first token is out

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.running:
                    self.spent[stage] += time.perf_counter() - start
        return timed

    def install(self, engine: Engine) -> None:
        for stage, path, name in STAGES:
            owner = getattr(engine, path, None) if path else engine
            if owner is not None:
                setattr(owner, name, self.wrap(stage, getattr(owner, name)))

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.spent[name] += time.perf_counter() - start


def stub_forward(engine: Engine) -> Callable[[], None]:
    """Replace the forward by zero logits (first turns: no 64K prefill on a CPU); returns the undo."""
    run = engine.runner.run

    def zeros(inputs, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(len(inputs), engine.model_config.vocab_size)

    engine.runner.run = zeros
    return lambda: setattr(engine.runner, "run", run)


def body(messages: list[dict[str, str]], conversation: str) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "stream": True,
                       "hearth": {"conversation_id": conversation}}).encode()


class Chat:
    def __init__(self, tokenizer: Tokenizer, name: str, context: int, seed: int) -> None:
        self.name = name
        self.messages = [{"role": "user", "content": words(tokenizer, context, seed)}]
        self.seed = seed

    def first_turn(self, engine: Engine) -> None:
        undo = stub_forward(engine)
        try:
            request_id = engine.add_request(self.messages, sampling={"max_tokens": ANSWER_TOKENS, "ignore_eos": True,
                                                                     "temperature": 0.0},
                                            conversation_id=self.name)
            text = ""
            while engine.has_unfinished():
                events = engine.step()
                text += "".join(e.text for e in events if isinstance(e, TokenDelta) and e.request_id == request_id)
        finally:
            undo()
        self.messages.append({"role": "assistant", "content": text})

    def follow_up(self, engine: Engine, stub: bool) -> dict[str, float]:
        """Time one new follow-up turn to its first token, by stage (ms)."""
        self.seed += 1
        messages = [*self.messages, {"role": "user", "content": words(engine.tokenizer, FOLLOW_UP_TOKENS, self.seed)}]
        clock = Clock()
        clock.install(engine)
        undo = stub_forward(engine) if stub else (lambda: None)
        start = time.perf_counter()
        try:
            with clock.stage("parse"):
                request = ChatCompletionRequest.model_validate_json(body(messages, self.name))
                check_text(request.model_dump())
                dicts = request.message_dicts()
            with clock.stage("add_request"):
                request_id = engine.add_request(dicts, sampling={"max_tokens": 2, "temperature": 0.0},
                                                conversation_id=self.name)
            first = None
            while first is None:
                with clock.stage("step"):
                    events = engine.step()
                first = next((e for e in events if isinstance(e, TokenDelta) and e.request_id == request_id), None)
                engine.stats()  # the server's snapshot, taken before the events go out
            total = time.perf_counter() - start
            clock.running = False
            while engine.has_unfinished():
                engine.step()
        finally:
            undo()
            for _, path, name in STAGES:  # drop the wrappers
                owner = getattr(engine, path, None) if path else engine
                if owner is not None and name in vars(owner):
                    delattr(owner, name)
        spent = dict(clock.spent)
        inner = sum(spent.get(s, 0.0) for s in ("render", "tokenise"))
        spent["add_request"] = spent.get("add_request", 0.0) - inner  # its own work
        inner = sum(spent.get(s, 0.0) for s in ("prefix match", "restore", "spill", "forward"))
        spent["step"] = spent.get("step", 0.0) - inner
        row = {k: v * 1e3 for k, v in spent.items()}
        row["total"] = total * 1e3
        row["host (total - forward)"] = row["total"] - row.get("forward", 0.0)
        return row


def drop_file_cache(folder: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_timing_scan(folder: Path, engine_config: EngineConfig) -> tuple[Engine, float]:
    """A new engine on the folder, and how long its prefix store took to read the segment headers."""
    scan = PrefixStore._scan
    spent: list[float] = []

    def timed_scan(self: PrefixStore) -> None:
        start = time.perf_counter()
        scan(self)
        spent.append(time.perf_counter() - start)

    PrefixStore._scan = timed_scan  # type: ignore[method-assign]
    try:
        return Engine.load(str(folder), engine_config), spent[0]
    finally:
        PrefixStore._scan = scan  # type: ignore[method-assign]


def config(args: argparse.Namespace, store: str) -> EngineConfig:
    pages = -(-(args.context + 1024) // BLOCK_SIZE)
    return EngineConfig(device="cpu", max_model_len=args.context + 1024, max_num_seqs=1, block_size=BLOCK_SIZE,
                        num_cache_blocks=pages, prefix_cache_offload=True, prefix_cache_dir=store,
                        max_num_batched_tokens=8192)


ORDER = ("parse", "render", "tokenise", "add_request", "prefix match", "restore", "spill", "forward", "step",
         "stats", "total", "host (total - forward)", "scan (not in TTFT)")


def report(rows: dict[str, list[dict[str, float]]]) -> None:
    print("median ms per stage (CPU)")
    print(f"{'stage':<24}" + "".join(f"{case:>12}" for case in rows))
    for stage in ORDER:
        cells = [statistics.median(r.get(stage, 0.0) for r in runs) for runs in rows.values()]
        print(f"{stage:<24}" + "".join(f"{c:>12.1f}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hearth-followup-ckpt")
    parser.add_argument("--stub-forward", action="store_true", help="zero logits for the follow-ups too")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    folder = write_checkpoint(args.dir)
    rows: dict[str, list[dict[str, float]]] = {"device": [], "switch": [], "restart": []}
    with tempfile.TemporaryDirectory(prefix="hearth-followup-cache-") as store:
        engine = Engine.load(str(folder), config(args, store))
        chat = Chat(engine.tokenizer, "chat-main", args.context, 1)
        chat.first_turn(engine)
        chat.follow_up(engine, args.stub_forward)  # warm-up (first use of every path)
        for rep in range(args.reps):
            rows["device"].append(chat.follow_up(engine, args.stub_forward))
            for other in range(2):  # two other chats fill the device cache: the main chat goes to RAM
                seed = 1000 + 10 * rep + other
                Chat(engine.tokenizer, f"chat-other-{rep}-{other}", args.context, seed).first_turn(engine)
            rows["switch"].append(chat.follow_up(engine, args.stub_forward))
        for rep in range(args.reps):
            # Another chat pushes the main one off the device, then the engine stops (saving its pages).
            Chat(engine.tokenizer, f"chat-last-{rep}", args.context, 2000 + rep).first_turn(engine)
            engine.close()
            drop_file_cache(Path(store))
            engine, scan_s = load_timing_scan(folder, config(args, store))
            warm = Chat(engine.tokenizer, f"chat-warm-{rep}", args.context, 3000 + rep)  # as bench_e2e warms
            warm.first_turn(engine)
            warm.follow_up(engine, args.stub_forward)
            row = chat.follow_up(engine, args.stub_forward)
            row["scan (not in TTFT)"] = scan_s * 1e3
            rows["restart"].append(row)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
