"""V5: the spec's HTTP scenarios against real ``flare run`` processes on the bundled catalog.

The bundled catalog (recipe ``flare-tiny``) has four request slots and a
4096-token prefill program, the shape the spec's scenarios name. ``flare run``
is started with no catalog argument, so it captures the bundled model itself
(once, into this test's pytest cache folder, keyed by the capture sources).
One server per speculation mode (``off``, ``fixed``, ``adaptive``) is started
at the beginning, all at once, so later modes load while earlier ones are
tested. Clients are the official ``openai`` package and raw ``httpx`` SSE.

Every scenario asserts complete, well-formed responses and prints token
counts, client-side SSE arrival gaps and graph-counter deltas from /metrics
(``pytest -s`` shows them). SSE arrival gaps are what a client sees; they are
not device times. ``FLARE_TEST_SCALE=ci`` runs only the adaptive server with
shorter prompts and outputs, on the bundled recipe captured with ``--compile
none`` (named on the command line), so a fresh CI machine compiles nothing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helios"))
from eager_target import next_token_logits, reference_choice  # noqa: E402
from server_process import start_server, wait_ready  # noqa: E402
from tiny_catalog import source_digest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FLARE = [sys.executable, "-m", "helios.cli"]
CI = os.environ.get("FLARE_TEST_SCALE") == "ci"
MODES = ("adaptive",) if CI else ("off", "fixed", "adaptive")
LONG = 1000 if CI else 2000  # tokens of a "long" prompt (the byte-level tokenizer: one per ASCII character)
DECODE = 24 if CI else 48  # output tokens of a decode stream
MODEL = "flare-tiny"
SLOTS = 4
EOS = (256, 258)  # <|endoftext|> and <|im_end|> of the bundled tokenizer
WORDS = ("river", "copper", "lantern", "orbit", "meadow", "signal", "harbor", "ember", "quartz", "willow")

pytestmark = pytest.mark.slow


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer

    from ignition.recipes import load_recipe

    return Tokenizer.from_file(str(load_recipe(MODEL).resolve().checkpoint_folder() / "tokenizer.json"))


def tokens_in(text: str) -> int:
    return len(_tokenizer().encode(text).ids)


def text_of(tokens: int, seed: int) -> str:
    """Text of exactly ``tokens`` tokens of the bundled tokenizer: whole words while they fit, then
    one-token fillers (BPE merges make a count reached by cutting characters jump past the target)."""
    rng = random.Random(seed)
    words, estimate = [], 0
    while estimate < tokens - 8:  # words are separate pre-tokens, so their counts add up (checked below)
        words.append(rng.choice(WORDS))
        estimate += _token_count(f" {words[-1]}")
    while words and _token_count(" ".join(words)) > tokens:
        words.pop()
    text = " ".join(words)
    while _token_count(text) < tokens:
        longer = f"{text} {rng.choice(WORDS)}" if text else rng.choice(WORDS)
        if _token_count(longer) > tokens:
            break
        text = longer
    while _token_count(text) < tokens:
        text = next(t for t in (text + f for f in FILLERS) if _token_count(t) == _token_count(text) + 1)
    assert _token_count(text) == tokens
    return text


FILLERS = (" x", " a", ".", "x", "!")


@functools.cache
def _bundled_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(REPO / "ignition/models/bundled/flare-tiny/target/tokenizer.json"))


def _token_count(text: str) -> int:
    return len(_bundled_tokenizer().encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


@dataclass
class Launch:
    mode: str
    process: subprocess.Popen
    log_path: Path
    base: str = ""  # known once the server logged where it listens


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """Start one ``flare run`` (bundled catalog) per mode, all at once; SIGTERM them at the end."""
    cache = getattr(request.config, "cache", None)
    name = f"flare-bundled-{source_digest()}"  # the capture sources, so a change captures afresh
    home = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    logs = tmp_path_factory.mktemp("v5-servers")
    catalog = _exported_bundle(home, logs) if CI else []
    started = {}
    for mode in MODES:
        process = start_server([*FLARE, "run", *catalog, "--threads", "1", "--speculation", mode],
                               logs / f"{mode}.log", cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(home)})
        started[mode] = Launch(mode, process, logs / f"{mode}.log")
    try:
        yield started
    finally:
        for launch in started.values():
            if launch.process.poll() is None:
                launch.process.send_signal(signal.SIGTERM)
        for launch in started.values():
            assert launch.process.wait(timeout=60) == 0, launch.log_path.read_text()[-2000:]


def _exported_bundle(home: Path, logs: Path) -> list[str]:
    """CI: the bundled recipe captured without AOTInductor (``--compile none``), so a fresh machine does not
    spend its CI budget compiling 14 programs; the scheduling these scenarios check is the same, on slower
    programs. The full run serves the bundled catalog itself (no catalog argument, compiled)."""
    folder = home / "exported"
    if not (folder / "catalog.yaml").is_file():
        with open(logs / "capture.log", "w") as log:
            subprocess.run([sys.executable, "-m", "ignition.cli", "capture", "flare-tiny", "--out", str(folder),
                            "--compile", "none"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=1200)
    return [str(folder)]


def _ready(launch: Launch, timeout_s: float = 600.0) -> Launch:
    # a first run captures the bundled model before loading it
    launch.base = launch.base or wait_ready(launch.process, launch.log_path, name="flare run", timeout_s=timeout_s)
    return launch


@pytest.fixture(scope="module", params=MODES)
def server(request, launches) -> Launch:
    return _ready(launches[request.param])


@pytest.fixture(scope="module")
def adaptive(launches) -> Launch:
    return _ready(launches["adaptive"])


# ---------------------------------------------------------------------------
# Clients and what they print
# ---------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    name: str
    sent: float
    arrivals: list[float] = field(default_factory=list)  # content chunks' arrival times
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None

    def gaps_ms(self) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(self.arrivals, self.arrivals[1:])]

    def describe(self) -> str:
        gaps = self.gaps_ms()
        first = 1e3 * (self.arrivals[0] - self.sent) if self.arrivals else float("nan")
        median = statistics.median(gaps) if gaps else float("nan")
        return (f"{self.name}: prompt {self.usage['prompt_tokens']} tok, output {self.usage['completion_tokens']} tok, "
                f"{self.finish_reason}; first chunk {first:.0f} ms, {len(self.arrivals)} chunks, "
                f"gap median {median:.1f} ms, max {max(gaps, default=0):.1f} ms")

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """A complete, well-formed stream: a finish reason, usage that adds up, text when tokens came."""
        assert self.finish_reason in ("length", "stop"), (self.name, self.finish_reason)
        assert self.usage is not None, f"{self.name}: no usage chunk"
        assert self.usage["prompt_tokens"] == prompt_tokens, (self.name, self.usage)
        assert 1 <= self.usage["completion_tokens"] <= max_tokens, (self.name, self.usage)
        assert self.usage["total_tokens"] == prompt_tokens + self.usage["completion_tokens"]
        if self.finish_reason == "length":
            assert self.usage["completion_tokens"] == max_tokens, (self.name, self.usage)


async def sse(client: httpx.AsyncClient, name: str, prompt: str, max_tokens: int, *, chunks: int | None = None,
              started: asyncio.Event | None = None, **extra) -> Stream:
    """POST a streamed completion and read its raw SSE.

    ``chunks``: disconnect after that many content chunks; ``started`` is set at the first one.
    """
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    stream = Stream(name, time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                break
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                stream.usage = event["usage"]
            for choice in event.get("choices") or ():
                stream.arrivals.append(time.perf_counter())
                stream.text += choice["text"]
                stream.finish_reason = choice["finish_reason"] or stream.finish_reason
            if started is not None and stream.arrivals:
                started.set()
            if chunks is not None and len(stream.arrivals) >= chunks:
                return stream  # leaving the block closes the connection mid-stream
    return stream


async def openai_stream(client: openai.AsyncOpenAI, name: str, prompt: str, max_tokens: int, **extra) -> Stream:
    """The same through the official client (chunks arrive as the client parses them)."""
    stream = Stream(name, time.perf_counter())
    response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}, **extra)
    async for chunk in response:
        if chunk.usage is not None:
            stream.usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            stream.arrivals.append(time.perf_counter())
            stream.text += choice.text
            stream.finish_reason = choice.finish_reason or stream.finish_reason
    return stream


def metrics(launch: Launch) -> str:
    return httpx.get(f"{launch.base}/metrics", timeout=10.0).text


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
            found[labels] = float(match.group(2))
    return found


def gauge(launch: Launch, name: str) -> float:
    return sum(samples(metrics(launch), name).values())


def counter_deltas(before: str, after: str) -> dict[str, int]:
    """Executions by ``graph_kind/category`` that moved between two scrapes."""
    old, new = samples(before, "flare_scheduler_executions_total"), samples(after, "flare_scheduler_executions_total")
    moved = {f"{dict(labels)['graph_kind']}/{dict(labels)['category']}": int(n - old.get(labels, 0))
             for labels, n in new.items()}
    return {key: n for key, n in sorted(moved.items()) if n}


def report(launch: Launch, title: str, streams: list[Stream], before: str) -> dict[str, int]:
    deltas = counter_deltas(before, metrics(launch))
    print(f"\n[{launch.mode}] {title}")
    for stream in streams:
        print("  " + stream.describe())
    print(f"  executions by graph_kind/category: {deltas}")
    return deltas


def settle(launch: Launch, timeout_s: float = 60.0) -> None:
    """Wait until no request holds a slot or a KV page (cancellations release after their last frame)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = metrics(launch)
        held = [sum(samples(text, name).values()) for name in
                ("flare_requests_running", "flare_requests_waiting", "flare_kv_pages_used")]
        if held == [0, 0, 0]:
            return
        time.sleep(0.1)
    raise AssertionError(f"slots or pages still held after {timeout_s} s: running/waiting/pages = {held}")


def run(coroutine):
    return asyncio.run(coroutine)


def http(launch: Launch) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=launch.base, timeout=300.0)


def oai(launch: Launch) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{launch.base}/v1", api_key="unused", max_retries=0, timeout=300.0)


# ---------------------------------------------------------------------------
# V5 scenarios, one server per mode
# ---------------------------------------------------------------------------


def test_V5_concurrent_long_prompts(server):
    before = metrics(server)

    async def go():
        async with oai(server) as client:
            return await asyncio.gather(*(openai_stream(client, f"long{i}", text_of(LONG, i), 16)
                                          for i in range(SLOTS)))

    streams = run(go())
    for stream in streams:
        stream.check(tokens_in(text_of(LONG, int(stream.name[4:]))), 16)
    deltas = report(server, f"{SLOTS} concurrent {LONG}-token prompts", streams, before)
    assert sum(n for key, n in deltas.items() if key.startswith(("prefill/", "mixed/"))) >= SLOTS
    settle(server)


@pytest.mark.parametrize("count", [2, 4])
def test_V5_decode_streams(server, count):
    before = metrics(server)

    async def go():
        async with http(server) as client:
            return await asyncio.gather(*(sse(client, f"decode{i}", f"Stream {i} says:", DECODE)
                                          for i in range(count)))

    streams = run(go())
    for i, stream in enumerate(streams):
        stream.check(tokens_in(f"Stream {i} says:"), DECODE)
    deltas = report(server, f"{count} decode streams", streams, before)
    # off: ordinary decode only; fixed: draft-keeping programs only (Y3); adaptive's default plain floor
    # (--adaptive-floor, a departure from Y3: docs/scheduling-utility.md, item 5) keeps both and picks by
    # measured cost, so either may run (the draft floor's Y3 check is in tests/helios/test_load_selection.py)
    generating = {"off": ("decode/",), "fixed": ("speculative/",)}.get(server.mode, ("speculative/", "decode/"))
    assert sum(n for key, n in deltas.items() if key.startswith(generating)) >= 1
    other = {"off": "speculative/", "fixed": "decode/"}.get(server.mode)
    assert other is None or not any(key.startswith(other) for key in deltas), deltas
    rounds = speculative_deltas(before, metrics(server))
    print(f"  speculative rounds/drafts/accepted by source: {rounds}")
    if server.mode == "fixed":  # one verification width, the widest: every round offers drafts
        assert sum(r["rounds"] for r in rounds.values()) >= 1, rounds
    if server.mode == "off":
        assert not rounds, rounds
    settle(server)


def speculative_deltas(before: str, after: str) -> dict[str, dict[str, int]]:
    """source -> changes of flare_speculative_{rounds,draft_tokens,accepted_tokens}_total (sources that moved)."""
    out: dict[str, dict[str, int]] = {}
    for short in ("rounds", "draft_tokens", "accepted_tokens"):
        name = f"flare_speculative_{short}_total"
        old, new = samples(before, name), samples(after, name)
        for labels, value in new.items():
            out.setdefault(dict(labels).get("source", "?"), {})[short] = int(value - old.get(labels, 0))
    return {source: moved for source, moved in out.items() if any(moved.values())}


def test_V5_long_prompt_arriving_during_decode(server):
    before = metrics(server)

    async def go():
        async with http(server) as client:
            events = [asyncio.Event() for _ in range(2)]
            decoders = [asyncio.create_task(sse(client, f"decode{i}", f"Decoder {i}:", 2 * DECODE, started=event))
                        for i, event in enumerate(events)]
            await asyncio.gather(*(event.wait() for event in events))  # both are decoding when the long one arrives
            long = await sse(client, "long", text_of(LONG, 99), 16)
            return [*(await asyncio.gather(*decoders)), long]

    streams = run(go())
    for i, stream in enumerate(streams[:2]):
        stream.check(tokens_in(f"Decoder {i}:"), 2 * DECODE)
    streams[2].check(tokens_in(text_of(LONG, 99)), 16)
    report(server, f"{LONG}-token prompt arriving during two decode streams", streams, before)
    settle(server)


def test_V5_short_and_long_prompt_contention(server):
    before = metrics(server)
    prompts = {"long0": text_of(LONG, 7), "short0": "Tell me a story.", "long1": text_of(LONG, 8),
               "short1": "Hi there!"}

    async def go():
        async with oai(server) as client:
            return await asyncio.gather(*(openai_stream(client, name, prompt, DECODE // 2)
                                          for name, prompt in prompts.items()))

    streams = run(go())
    for stream, prompt in zip(streams, prompts.values()):
        stream.check(tokens_in(prompt), DECODE // 2)
    report(server, "two long and two short prompts at once", streams, before)
    settle(server)


def test_V5_cancellation_then_slot_reuse(server):
    before = metrics(server)

    async def go():
        async with http(server) as client:
            cut = await asyncio.gather(*(sse(client, f"cut{i}", f"Cancelled {i}:", 4000, chunks=2)
                                         for i in range(SLOTS)))
            settle(server)  # every disconnect cancelled its request and freed its slot and pages
            again = await asyncio.gather(*(sse(client, f"reuse{i}", f"Reused {i}:", DECODE) for i in range(SLOTS)))
            return cut, again

    cut, again = run(go())
    assert all(len(stream.arrivals) == 2 and stream.finish_reason is None for stream in cut)
    for i, stream in enumerate(again):
        stream.check(tokens_in(f"Reused {i}:"), DECODE)
    after = metrics(server)
    outcomes = samples(after, "flare_requests_total")
    cancelled = sum(n for labels, n in outcomes.items() if ("outcome", "cancelled") in labels)
    assert cancelled >= SLOTS, outcomes
    report(server, f"{SLOTS} streams cut after two chunks, then {SLOTS} new ones", again, before)
    settle(server)


# ---------------------------------------------------------------------------
# Exactness and robustness over HTTP
# ---------------------------------------------------------------------------


def eager_greedy(prompt: list[int], count: int) -> list[int]:
    """Greedy continuation by the bundled target model run eagerly (the test's reference, not the runtime's)."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(next_token_logits(tokens).argmax()))
        if tokens[-1] in EOS:  # the server stops there too
            break
    return tokens[len(prompt):]


def test_greedy_output_over_http_equals_the_eager_model(server):
    tokenizer = _tokenizer()
    for prompt in ("The lantern by the river", "Once upon a time, in a quiet harbor,"):
        ids = tokenizer.encode(prompt).ids
        expected = eager_greedy(ids, 24)
        body = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0}
        answer = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120.0).json()
        shown = tokenizer.decode([t for t in expected if t not in EOS])
        text = answer["choices"][0]["text"]
        if text == shown:
            assert answer["usage"]["completion_tokens"] == len(expected)
            continue
        # The server's batched programs and the eager model may part only at a near-tie: find the first
        # reference token whose text the answer does not continue, and check that choice's margin.
        agree = max(i for i in range(len(expected) + 1)
                    if text.startswith(tokenizer.decode([t for t in expected[:i] if t not in EOS])))
        _, gap, margin = reference_choice([*ids, *expected[:agree]])
        assert gap <= margin, (prompt, expected, text, f"diverged at {agree} with a top-two gap of {gap:.3g}")


def test_seeded_sampling_reproduces_alone_and_among_other_requests(adaptive):
    prompt = "A seeded story:"

    async def sampled(client, seed, temperature=1.0):
        reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=temperature,
                                                seed=seed, top_p=0.95)
        return reply.choices[0].text

    async def go():
        async with oai(adaptive) as client:
            alone = await sampled(client, 1234)
            crowd = await asyncio.gather(sampled(client, 1234), sampled(client, 5, 0.7), sampled(client, 1234),
                                         sampled(client, 6, 1.3), sampled(client, 0, 0.0))
            others = await asyncio.gather(*(sampled(client, seed) for seed in (1, 2, 3)))
            return alone, crowd, others

    alone, crowd, others = run(go())
    # Text only, so no near-tie allowance here: a flip would need two noised scores within the model's
    # tolerance (about 1e-3 of their scale). The engine-level twin of this test compares token ids with
    # that allowance (test_engine_phases.py::test_seeded_sampling_reproduces_across_different_concurrency).
    assert crowd[0] == alone and crowd[2] == alone
    assert any(text != alone for text in others), "other seeds should not all give the same sample"


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.01}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": 17}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": text_of(4200, 1)}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text_of(4200, 2)}]}, 400),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_bad_requests_get_4xx_in_openai_error_shape_never_5xx(adaptive, stream):
    with httpx.Client(base_url=adaptive.base, timeout=60.0) as client:
        for route, body, status in BAD:
            if stream and isinstance(body, dict):
                body = body | {"stream": body.get("stream", True)}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = client.post(route, content=content, headers={"content-type": "application/json"})
            assert response.status_code == status, (route, str(body)[:120], response.status_code, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    too_long = httpx.post(f"{adaptive.base}/v1/completions", json=BAD[-2][1]).json()["error"]["message"]
    # the context /v1/models reports: the recipe's 4096, less the draft steps prefix-limit rounds keep free
    context = httpx.get(f"{adaptive.base}/v1/models").json()["data"][0]["max_model_len"]
    assert 4090 <= context <= 4096 and "4200" in too_long and str(context) in too_long, too_long


def test_200_requests_with_random_disconnects_leave_no_slot_or_page_held(adaptive):
    rng = random.Random(2024)
    plans = [(rng.choice(("finish", "cut", "cut_early", "whole")), rng.randint(2, 12 if CI else 16))
             for _ in range(200)]

    async def one(client, index, plan, limit):
        prompt = f"Request {index}: " + text_of(rng.randint(4, 200), index)
        if plan == "whole":
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                   "max_tokens": limit})
            assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]
            return "finished"
        chunks = {"finish": None, "cut": max(1, limit // 2), "cut_early": 1}[plan]
        stream = await sse(client, f"r{index}", prompt, limit, chunks=chunks, temperature=0.8, seed=index)
        return "finished" if stream.finish_reason else "cut"

    async def go():
        gate = asyncio.Semaphore(8)  # at most eight connections at once: the rest wait in the client

        async def guarded(index, plan, limit):
            async with gate:
                return await one(client, index, plan, limit)

        async with http(adaptive) as client:
            return await asyncio.gather(*(guarded(i, plan, limit) for i, (plan, limit) in enumerate(plans)))

    before = metrics(adaptive)
    outcomes = run(go())
    settle(adaptive)
    after = metrics(adaptive)
    assert outcomes.count("cut") > 20 and outcomes.count("finished") > 20
    assert gauge(adaptive, "flare_kv_pages_free") > 0
    print(f"\n[adaptive] 200 requests: {outcomes.count('finished')} finished, {outcomes.count('cut')} cut; "
          f"executions {counter_deltas(before, after)}")
