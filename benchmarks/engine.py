"""Engine throughput next to Hugging Face ``generate`` on the same model: tokens/s, side by side.

    python benchmarks/engine.py [--preset small] [--threads 2] [--repeats 5] [--sampling greedy]

Builds a checkpoint of ``--preset`` in a temp dir, starts one engine process on it
(``--num-threads --threads``) and loads the same checkpoint with ``AutoModelForCausalLM`` in this
process (``torch.set_num_threads(--threads)``). Every request has a prompt of about
``--prompt-tokens`` token ids (lengths vary by a few tokens, so batches need padding) and
generates exactly ``--new-tokens`` tokens (``ignore_eos``; HF: ``min_new_tokens = max_new_tokens``).
Then, after a warm-up, for each of ``--repeats`` rounds (the four measurements interleaved so a
noisy neighbour hurts all of them alike):

- engine, 1 client: one client sends ``--requests`` requests one after another (closed loop);
- engine, N clients (``--clients``, default 8): N clients do the same at once (continuous batching);
- HF single: ``--requests`` calls of ``model.generate`` with one prompt each;
- HF batched: ``--requests`` calls of ``model.generate`` with the N prompts left-padded together.

Only the engine serves while the engine is measured and only this process computes while HF is,
so neither steals the other's cores. The rounds are then repeated after one
``/update_weights_from_disk`` to a second checkpoint of the preset (``--no-update`` skips this),
because an RL engine serves right after updates; HF rows pool both phases.

Prints generated tokens/s (best of the rounds, median beside it) and the ratios engine / HF
batched and engine / HF single; target: the engine at N clients at least matches HF batched.
Greedy outputs of a single request are compared token by token between the engine and HF, so
both sides are known to do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import httpx
import torch
from _common import BenchmarkError, Samples, check_response, engine_process, load_line, machine_line
from transformers import AutoModelForCausalLM, PreTrainedModel

from miles.models.presets import init_checkpoint
from miles.models.tokenizer import PAD_TOKEN_ID
from miles.utils.progress_bars import disable_library_progress_bars


class Sampling(Enum):
    GREEDY = "greedy"
    SAMPLED = "sampled"  # temperature 1, no top-k / top-p filtering, seeded per request


@dataclass(frozen=True)
class Workload:
    """What every measurement generates: the same prompts, the same lengths, the same sampling."""

    prompts: tuple[tuple[int, ...], ...]  # one per client / batch row
    new_tokens: int
    requests: int  # per client (engine) or generate calls (HF)
    sampling: Sampling

    def sampling_params(self, seed: int) -> dict[str, object]:
        params: dict[str, object] = {"max_new_tokens": self.new_tokens, "ignore_eos": True}
        if self.sampling is Sampling.GREEDY:
            params["temperature"] = 0.0
        else:
            params.update(temperature=1.0, top_p=1.0, top_k=-1, sampling_seed=seed)
        return params


class Side(Enum):
    ENGINE = "engine"
    HF = "HF generate"


class Phase(Enum):
    FRESH = ""
    AFTER_UPDATE = ", after an update"


@dataclass(frozen=True)
class Series:
    """One line of the table: who generates, how many sequences side by side, and when."""

    side: Side
    streams: int  # 1 for a single client / one prompt per generate call
    phase: Phase = Phase.FRESH

    @property
    def name(self) -> str:
        if self.side is Side.HF:
            return f"{self.side.value}, {'1 at a time' if self.streams == 1 else f'batch of {self.streams}'}"
        clients = "1 client" if self.streams == 1 else f"{self.streams} clients"
        return f"{self.side.value}, {clients}{self.phase.value}"


@dataclass(frozen=True)
class Row:
    series: Series
    tokens: int
    samples: Samples

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.samples.best


def make_prompts(count: int, *, length: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """``count`` prompts of byte-token ids, lengths spread over ``length - 4 .. length + 3``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [max(1, length - 4 + (i % 8)) for i in range(count)]
    return tuple(tuple(torch.randint(0, 256, (n,), generator=generator).tolist()) for n in lengths)


# --- the engine, over HTTP --------------------------------------------------------------------


async def _client(
    http: httpx.AsyncClient, url: str, *, prompt: tuple[int, ...], work: Workload, seed: int
) -> list[list[int]]:
    outputs = []
    for i in range(work.requests):
        body = {"input_ids": list(prompt), "sampling_params": work.sampling_params(seed * 1000 + i)}
        result = check_response(await http.post(f"{url}/generate", json=body), what="/generate")
        if result["meta_info"]["completion_tokens"] != work.new_tokens:
            raise BenchmarkError("the engine generated a different number of tokens", meta=result["meta_info"])
        outputs.append(result["output_ids"])
    return outputs


def run_engine(url: str, work: Workload, *, clients: int) -> list[list[int]]:
    """``clients`` closed-loop clients, each sending ``work.requests`` requests; all outputs."""

    async def run() -> list[list[int]]:
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(trust_env=False, timeout=600.0, limits=limits) as http:
            per_client = await asyncio.gather(
                *[_client(http, url, prompt=work.prompts[c], work=work, seed=c) for c in range(clients)]
            )
        return [out for outs in per_client for out in outs]

    return asyncio.run(run())


def engine_stats(url: str) -> tuple[int, int]:
    """(decode steps, tokens generated) so far, from ``/get_server_info``."""
    state = check_response(httpx.get(f"{url}/get_server_info", trust_env=False), what="/get_server_info")
    internal = state["internal_states"][0]
    return int(internal["decode_steps"]), int(internal["tokens_generated"])


# --- Hugging Face generate, in this process ---------------------------------------------------


def hf_generate(model: PreTrainedModel, prompts: list[tuple[int, ...]], work: Workload) -> list[list[int]]:
    """One ``model.generate`` call on ``prompts`` left-padded into one batch; the new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = copy.deepcopy(model.generation_config)
    config.pad_token_id = PAD_TOKEN_ID
    # HF's way to ignore EOS: mask it until max_new_tokens (a config without eos_token_id still
    # stops at the model's EOS).
    config.max_new_tokens = config.min_new_tokens = work.new_tokens
    if work.sampling is Sampling.GREEDY:
        config.do_sample = False
        config.temperature = config.top_p = config.top_k = None
    else:
        config.do_sample, config.temperature, config.top_p, config.top_k = True, 1.0, 1.0, 0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out[:, width:]
    if new.shape[1] != work.new_tokens:
        raise BenchmarkError("generate returned a different number of tokens", got=int(new.shape[1]))
    return new.tolist()


def run_hf(model: PreTrainedModel, work: Workload, *, batch: int) -> list[list[int]]:
    outputs = []
    for _ in range(work.requests):
        outputs.extend(hf_generate(model, list(work.prompts[:batch]), work))
    return outputs


# --- measuring --------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def update_weights(url: str, checkpoint: Path) -> None:
    body = {"model_path": str(checkpoint)}
    response = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=600, trust_env=False)
    if not check_response(response, what="/update_weights_from_disk")["success"]:
        raise BenchmarkError("the engine refused the update", body=response.text[:500])


def measure(
    *, url: str, model: PreTrainedModel, work: Workload, series: tuple[Series, Series, Series, Series], repeats: int
) -> tuple[dict[Series, list[float]], float]:
    """``repeats`` interleaved rounds of engine 1 / N clients and HF single / batched.

    Returns the seconds per series and the engine's mean rows per decode step with N clients.
    """
    engine_one, engine_many, hf_one, hf_many = series
    seconds: dict[Series, list[float]] = {s: [] for s in series}
    steps = tokens = 0
    for _ in range(repeats):
        before = engine_stats(url)
        seconds[engine_many].append(timed(lambda: run_engine(url, work, clients=engine_many.streams)))
        after = engine_stats(url)
        steps, tokens = steps + after[0] - before[0], tokens + after[1] - before[1]
        seconds[engine_one].append(timed(lambda: run_engine(url, work, clients=1)))
        seconds[hf_many].append(timed(lambda: run_hf(model, work, batch=hf_many.streams)))
        seconds[hf_one].append(timed(lambda: run_hf(model, work, batch=1)))
    return seconds, tokens / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, engine and HF alike (default 2)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients / HF batch size (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="about this many prompt tokens (default 16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client / generate calls (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; best and median reported (default 5)")
    parser.add_argument("--sampling", choices=[s.value for s in Sampling], default=Sampling.GREEDY.value)
    parser.add_argument(
        "--no-update", action="store_true", help="skip the second phase (after one /update_weights_from_disk)"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    n = args.clients
    work = Workload(
        prompts=make_prompts(n, length=args.prompt_tokens, seed=0),
        new_tokens=args.new_tokens,
        requests=args.requests,
        sampling=Sampling(args.sampling),
    )
    hf_one, hf_many = Series(Side.HF, 1), Series(Side.HF, n)
    before = (Series(Side.ENGINE, 1), Series(Side.ENGINE, n))
    after = (Series(Side.ENGINE, 1, Phase.AFTER_UPDATE), Series(Side.ENGINE, n, Phase.AFTER_UPDATE))
    print(machine_line())
    print(load_line(), "(before)")
    warmup = dataclasses.replace(work, new_tokens=4, requests=1)
    seconds: dict[Series, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-") as tmp:
        checkpoint, other = Path(tmp) / args.preset, Path(tmp) / f"{args.preset}-seed1"
        init_checkpoint(checkpoint, model_name=args.preset, preset=args.preset, seed=0, step=1)
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype="auto").eval()
        params = sum(p.numel() for p in model.parameters())
        print(
            f"preset {args.preset} ({params / 1e6:.1f}M params, {model.dtype}), {args.threads} torch threads; "
            f"{n} prompts of {min(map(len, work.prompts))}-{max(map(len, work.prompts))} tokens, "
            f"{args.new_tokens} new tokens each, {args.sampling}, {args.requests} requests per client, "
            f"{args.repeats} rounds"
        )
        with engine_process(checkpoint, log_dir=Path(tmp), threads=args.threads) as engine:
            print(f"engine healthy after {engine.start_s:.1f}s")
            # Warm-up: first calls pay for lazy initialisation on both sides.
            run_engine(engine.url, warmup, clients=n)
            run_hf(model, warmup, batch=n)
            run_hf(model, warmup, batch=1)
            if work.sampling is Sampling.GREEDY:
                single = dataclasses.replace(work, requests=1)
                ours, theirs = run_engine(engine.url, single, clients=1), run_hf(model, single, batch=1)
                same = sum(a == b for a, b in zip(ours[0], theirs[0], strict=True))
                note = ""
                if model.dtype != torch.float32:
                    # The engine's decode attention rounds like SDPA's kernel but not to the bit.
                    note = " (reduced precision: a near-tie in a random model's logits can flip a token)"
                print(f"greedy output, engine vs HF (one request): {same}/{work.new_tokens} tokens equal{note}")

            first, rows_per_step = measure(
                url=engine.url, model=model, work=work, series=(*before, hf_one, hf_many), repeats=args.repeats
            )
            seconds.update(first)
            if not args.no_update:
                # RL engines serve right after weight updates, so that is measured too: one update
                # to another checkpoint of the same preset, then the same rounds again.
                init_checkpoint(other, model_name=args.preset, preset=args.preset, seed=1, step=2)
                update_weights(engine.url, other)
                run_engine(engine.url, warmup, clients=n)
                second, _ = measure(
                    url=engine.url, model=model, work=work, series=(*after, hf_one, hf_many), repeats=args.repeats
                )
                for key, values in second.items():
                    seconds.setdefault(key, []).extend(values)
    print(load_line(), "(after)")

    per_request = args.requests * args.new_tokens
    rows = [Row(s, per_request * s.streams, Samples(tuple(values))) for s, values in seconds.items()]
    order = [*before, *after, hf_one, hf_many]
    rows.sort(key=lambda row: order.index(row.series))
    by_series = {row.series: row for row in rows}
    single, batched = by_series[hf_one], by_series[hf_many]
    print(
        f"\n{'what':<38} {'tokens':>7} {'best s':>8} {'median s':>9} {'tok/s':>8} "
        f"{'x HF batched':>13} {'x HF single':>12}"
    )
    for row in rows:
        ratios = (
            f"{row.tokens_per_s / batched.tokens_per_s:13.2f} {row.tokens_per_s / single.tokens_per_s:12.2f}"
            if row.series.side is Side.ENGINE
            else ""
        )
        print(
            f"{row.series.name:<38} {row.tokens:>7} {row.samples.best:8.3f} {row.samples.median:9.3f} "
            f"{row.tokens_per_s:8.0f} {ratios}"
        )
    print(f"\nengine with {n} clients: {rows_per_step:.2f} rows per decode step on average (max {n})")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()
