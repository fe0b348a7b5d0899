"""``flare run``'s startup: a short sequence of named, logged steps (STYLE.md 7).

0. claim the listening address, so a busy port is one line before any work;
1. find the catalog (with none given: the bundled default, captured once into
   a per-user cache folder under a file lock; the only runtime path that
   imports ``ignition``, lazily);
2. load and validate it: the manifest and files (``helios.catalog.load.load``),
   every program archive unless ``--trust-catalog``, and that this machine can
   hold its state;
3. allocate the persistent state and build the engine (scheduler, pages);
4. warm up: load every program and call it once with all rows inactive;
5. serve over HTTP until SIGTERM/SIGINT, then drain;
6. with ``--dump-estimates FILE``: write the learned durations (helios/sim/estimates.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from flare_contract.manifest import FORMAT_VERSION
from helios.catalog import released
from helios.catalog.load import Catalog, CatalogError, load
from helios.ops.linear import choose_linear_kernels
from helios.runtime.engine import ADAPTIVE_FLOORS, EngineConfig, HeliosEngine, select_programs
from helios.sim.estimates import estimates_document, write_estimates
from helios.scheduler.config import CHOICE_FIELDS, POLICY_PRESETS, SPECULATION_MODES, PolicyConfig
from helios.runtime.waiting import DEFAULT_MAX_WAITING

log = logging.getLogger("flare.run")

DEFAULT_RECIPE = "flare-tiny"


class LaunchError(ValueError):
    """A flag or catalog ``flare run`` cannot use; the message says what would be right."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    """``flare run``'s flags, validated at construction."""

    catalog: Path | None = None  # None: the bundled default
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "balanced"
    alpha: float | None = None
    speculation: str = "adaptive"
    api_key: str | None = None
    threads: int | None = None
    speculative_width: int | None = None  # None: every width the catalog has
    dump_estimates: Path | None = None
    trust_catalog: bool = False  # load the catalog's programs uninspected (docs/catalog-format.md, "Trust")
    max_waiting: int = DEFAULT_MAX_WAITING  # requests without a slot beyond which new ones get 503
    queue_timeout: float | None = None  # seconds a request may wait for a slot (None: no limit)
    log_requests: bool = True  # an access-log line on stdout per finished request (--disable-log-requests)
    log_stats_interval: float = 10.0  # seconds between stats lines on stdout; 0: none (--log-stats-interval)
    # --scheduler-choice FIELD=0|1: PolicyConfig's price-flow choices (docs/scheduling-utility.md,
    # "Departures from the spec"), applied after the preset
    choices: tuple[str, ...] = ()
    # --prefix-reuse/--no-prefix-reuse; None (neither): on where the catalog keeps a checkpoint store
    prefix_reuse: bool | None = None
    terminal_value: float | None = None  # --scheduler-terminal-value (None: the policy's)
    terminal_age_price: float | None = None  # --scheduler-terminal-age-price
    adaptive_floor: str | None = None  # --adaptive-floor plain|draft (None: the engine's default); adaptive only

    def __post_init__(self) -> None:
        if self.policy not in POLICY_PRESETS:
            raise LaunchError(f"--scheduler-policy {self.policy!r} is unknown; use one of {', '.join(POLICY_PRESETS)}")
        for flag, value in (("--scheduler-terminal-value", self.terminal_value),
                            ("--scheduler-terminal-age-price", self.terminal_age_price)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise LaunchError(f"{flag} must be a finite number >= 0, got {value}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise LaunchError(f"--mtp-adaptive-verification-alpha must be a finite number > 0, got {self.alpha}")
        if self.speculation not in SPECULATION_MODES:
            raise LaunchError(f"--speculation {self.speculation!r} is unknown; use one of {', '.join(SPECULATION_MODES)}")
        if self.threads is not None and self.threads < 1:
            raise LaunchError(f"--threads must be >= 1, got {self.threads}")
        if not 0 <= self.port <= 65535:
            raise LaunchError(f"--port must be in 0..65535, got {self.port}")
        if self.speculative_width is not None and self.speculative_width < 1:
            raise LaunchError(f"--speculative-width must be >= 1 (positions per row, pending token included), "
                              f"got {self.speculative_width}")
        if self.max_waiting < 1:
            raise LaunchError(f"--max-waiting must be >= 1 (requests waiting for a slot), got {self.max_waiting}")
        if self.queue_timeout is not None and not (math.isfinite(self.queue_timeout) and self.queue_timeout > 0):
            raise LaunchError(f"--queue-timeout must be a finite number of seconds > 0, got {self.queue_timeout}")
        if not (math.isfinite(self.log_stats_interval) and self.log_stats_interval >= 0):
            raise LaunchError(f"--log-stats-interval must be a finite number of seconds >= 0 (0 turns the stats "
                              f"line off), got {self.log_stats_interval}")
        if self.dump_estimates is not None and not self.dump_estimates.parent.is_dir():
            raise LaunchError(f"--dump-estimates {self.dump_estimates}: folder {self.dump_estimates.parent} "
                              "does not exist")

        if self.adaptive_floor is not None:
            if self.adaptive_floor not in ADAPTIVE_FLOORS:
                raise LaunchError(f"--adaptive-floor {self.adaptive_floor!r} is unknown; use one of "
                                  f"{', '.join(ADAPTIVE_FLOORS)}")
            if self.speculation != "adaptive":
                raise LaunchError(f"--adaptive-floor applies to --speculation adaptive only, not "
                                  f"{self.speculation}")
        parse_choices(self.choices)

    def policy_config(self) -> PolicyConfig:
        preset = PolicyConfig.preset(self.policy, adaptive_verification_alpha=self.alpha,
                                     terminal_value=self.terminal_value, terminal_age_price=self.terminal_age_price)
        return replace(preset, **parse_choices(self.choices))

    def engine_config(self, catalog: Catalog) -> EngineConfig:
        """Threads default to every core: the device worker's program calls are the hot path."""
        threads = self.threads or os.cpu_count() or 1
        config = EngineConfig(self.policy_config(), self.speculation, threads, str(catalog.manifest.device["kind"]),
                              speculative_width=self.speculative_width, max_waiting=self.max_waiting,
                              queue_timeout_s=self.queue_timeout, prefix_reuse=self.prefix_reuse is not False)
        return config if self.adaptive_floor is None else replace(config, adaptive_floor=self.adaptive_floor)

    def check_selection(self, catalog: Catalog) -> None:
        """``--speculation``/``--speculative-width`` must name programs the catalog has (spec C6, Y3)."""
        try:
            select_programs(catalog.descriptors, self.speculation, self.speculative_width)
        except ValueError as exc:
            width = "" if self.speculative_width is None else f" --speculative-width {self.speculative_width}"
            raise LaunchError(f"--speculation {self.speculation}{width}: {exc}") from None
        if self.prefix_reuse is True and catalog.checkpoint_rows == 0:  # asked for; by default it is just off
            raise LaunchError(f"--prefix-reuse: catalog {catalog.path} keeps no checkpoint store (recipe "
                              "`checkpoints: {rows: N}`, docs/checkpoints.md); capture one with it, or drop the flag")


def parse_choices(items) -> dict[str, int]:
    """``--scheduler-choice FIELD=0|1`` items as PolicyConfig overrides; a bad item is a LaunchError."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in CHOICE_FIELDS or value not in ("0", "1"):
            raise LaunchError(f"--scheduler-choice {item!r}: expected FIELD=0 or FIELD=1 with FIELD one of "
                              f"{', '.join(CHOICE_FIELDS)}")
        out[name] = int(value)
    return out


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


def open_catalog(options: RunOptions) -> Catalog:
    """Steps 1-2: the catalog found, validated and judged servable here, before any program runs."""
    folder = options.catalog or bundled_catalog()
    # The bundled catalog is Flare's own capture into its own cache (compiled programs included), so it is trusted
    # as Flare's installed code is; a catalog named on the command line needs --trust-catalog for native code.
    trust = options.trust_catalog or options.catalog is None
    catalog = _step(f"load catalog {folder}", lambda: _load(folder, trust))
    check_servable(catalog)
    options.check_selection(catalog)
    return catalog


def prepare_engine(options: RunOptions) -> HeliosEngine:
    """Steps 1-4: the engine ready to serve (each step logged with its duration)."""
    catalog = open_catalog(options)
    engine = _step("allocate state and build the engine", lambda: HeliosEngine(catalog, options.engine_config(catalog)))
    log.info("torch threads: %d intra-op (--threads)", torch.get_num_threads())
    if engine.executor.device.type == "cpu":
        _step("choose flare::linear's loop order and its kernel for prompt chunks", lambda: _choose_linear_kernel(catalog))
    _prepare_compiled_call(catalog)
    _step(f"warm up {len(engine.scheduler.graphs)} programs", lambda: _warm_up(engine))
    return engine


def _prepare_compiled_call(catalog: Catalog) -> None:
    """Check FLARE_COMPILED_CALL, and where compiled programs will run, build the call that runs them
    without the GIL (helios.catalog.released; FLARE_COMPILED_CALL=held keeps torch's own)."""
    try:
        released.choice()
    except released.CompiledCallChoiceError as exc:
        raise LaunchError(str(exc)) from None
    if catalog.trusted and any(entry.compiled_file for entry in catalog.manifest.programs):
        _step("prepare the compiled programs' call", lambda: log.info("%s", released.prepare()))


def _choose_linear_kernel(catalog: Catalog) -> None:
    """The native kernel's loop order at 16 and 32 rows, then the native kernel or ATen's GEMM above 16
    rows, whichever ran the catalog's weights faster here (helios.ops.linear: choose_chunk_rows,
    choose_native_rows; FLARE_LINEAR_CHUNK_ROWS and FLARE_LINEAR_NATIVE_ROWS fix them)."""
    try:
        choices = choose_linear_kernels(t for weights in catalog.weights.values() for t in weights.values())
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    for choice in choices:
        log.info("%s", choice.describe())


def run(options: RunOptions) -> None:
    """``flare run``: claim the address, prepare the engine, then serve until told to stop."""
    from helios.server.app import ServerConfig
    from helios.server.serve import body_limit, uvicorn_server

    listener = bind_listener(options.host, options.port)
    try:
        engine = prepare_engine(options)
        api_key = options.api_key or os.environ.get("FLARE_API_KEY") or None
        max_body = body_limit(engine.context_length, engine.tokenizer.max_token_bytes) or ServerConfig().max_body_bytes
        log.info("request bodies up to %d bytes (what a %d-token prompt can need)", max_body, engine.context_length)
        route_server_logs_to_stdout()
        config = ServerConfig(api_key=api_key, max_body_bytes=max_body, log_requests=options.log_requests,
                              log_stats_interval_s=options.log_stats_interval)
        server = uvicorn_server(engine, config, options.host, options.port,
                                log_level="warning")
        log.info("ready on http://%s:%d (model %s)", options.host, listener.getsockname()[1], engine.model_name)
        server.run(sockets=[listener])
    finally:
        listener.close()
    if options.dump_estimates is not None:
        dump_estimates(engine, options.dump_estimates)


def route_server_logs_to_stdout() -> None:
    """The access log and the stats line go to stdout, as vLLM prints them; startup logs stay on stderr."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    for name in ("flare.requests", "flare.stats"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _Listener(socket.socket):
    """The bound socket, holding its address claim (``_claim_address``) until it is closed."""

    __slots__ = ("claim",)

    def close(self) -> None:
        super().close()
        claim, self.claim = getattr(self, "claim", None), None
        if claim is not None:
            claim.close()


def bind_listener(host: str, port: int) -> socket.socket:
    """Step 0: bind the address now, so a busy port fails before minutes of capture and warm-up.

    Bound, not yet listening: until the server starts, connections are refused
    rather than left waiting in a backlog. Port 0 picks a free port (logged as ready).
    SO_REUSEADDR (as uvicorn sets it, to restart past TIME_WAIT) also lets a second
    socket bind the same port while neither listens, so two servers starting at once
    both passed this step; an exclusive lock on the address settles which one owns it.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise LaunchError(f"--host {host}: not an address this machine can listen on ({exc.strerror})") from None
    listener = _Listener(family, kind, proto)
    listener.claim = None
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise LaunchError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); "
                          "stop what uses it or pick another --port") from None
    if port:
        listener.claim = _claim_address(listener, host, port)
    return listener


def _claim_address(listener: socket.socket, host: str, port: int):
    """An exclusive lock on a file named by the bound address, held while the listener lives, or None
    where the lock folder cannot be written (the bind is then the only check, as before)."""
    bound = listener.getsockname()[0]
    folder = cache_root().parent / "ports"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        claim = open(folder / f"{bound.replace(':', '_')}-{port}.lock", "w")
    except OSError:
        log.debug("no address lock for %s:%d", bound, port, exc_info=True)
        return None
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        claim.close()
        listener.close()
        raise LaunchError(f"--host {host} --port {port}: another server is starting on that address; "
                          "stop it or pick another --port") from None
    return claim


def dump_estimates(engine: HeliosEngine, path: Path) -> None:
    """Step 6: the scheduler's learned durations as a synthetic catalog ``flare simulate`` reads."""
    text = estimates_document(engine.scheduler.graphs, engine.learned_durations(), engine.scheduler.request_slots,
                              f"{engine.model_name} ({engine.catalog.path})")
    if text is None:
        log.warning("no program was measured; %s not written", path)
        return
    write_estimates(path, text)
    log.info("learned durations written to %s", path)


def _step(name: str, action):
    began = time.monotonic()
    log.info("%s ...", name)
    result = action()
    log.info("%s: done in %.1f s", name, time.monotonic() - began)
    return result


def _load(folder: Path, trust: bool) -> Catalog:
    try:
        catalog = load(folder, trust=trust)
    except FileNotFoundError as exc:
        raise LaunchError(f"{folder}: {exc}") from exc
    catalog.check_programs()
    return catalog


def check_servable(catalog: Catalog) -> None:
    """What the engine needs beyond a valid catalog: a paged cache, its device, room for state and weights."""
    layout, kind = catalog.state.layout, str(catalog.manifest.device["kind"])
    missing = [key for key in ("request_slots", "page_size", "num_pages", "max_pages_per_slot") if key not in layout]
    if missing:
        raise LaunchError(f"{catalog.path}: its state has no paged KV cache (layout lacks {', '.join(missing)}); "
                          "flare run serves model catalogs written by `ignition capture`")
    if kind == "cuda" and not torch.cuda.is_available():
        raise LaunchError(f"{catalog.path}: captured for cuda, but this machine has no CUDA device")
    needed, memory = _resident_bytes(catalog), _device_memory(kind)
    if memory is not None and needed > memory:
        raise LaunchError(f"{catalog.path}: its state and weights need {needed / 2**30:.1f} GiB, more than this "
                          f"machine's {memory / 2**30:.1f} GiB of {kind} memory")
    _check_tokenizer(catalog)


def _resident_bytes(catalog: Catalog) -> int:
    state = sum(math.prod(t.shape) * getattr(torch, t.dtype).itemsize for t in catalog.state.tensors)
    return state + sum((catalog.path / w.file).stat().st_size for w in catalog.manifest.weights)


def _device_memory(kind: str) -> int | None:
    if kind == "cuda":
        return torch.cuda.mem_get_info()[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _check_tokenizer(catalog: Catalog) -> None:
    from tokenizers import Tokenizer

    path = catalog.tokenizer_path / "tokenizer.json"
    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
        raise LaunchError(f"{path}: not a tokenizer the tokenizers library reads ({' '.join(str(exc).split())[:200]})") from None


def _warm_up(engine: HeliosEngine) -> None:
    """A program that cannot run here (damaged, or built for another machine) is one line, not a traceback."""
    try:
        engine.warm_up()
    except CatalogError:
        raise
    except Exception as exc:
        log.debug("warm-up failed", exc_info=True)
        raise LaunchError(f"{engine.catalog.path}: warm-up failed ({exc.__class__.__name__}: "
                          f"{' '.join(str(exc).split())[:300]}); the catalog's programs do not run here") from None


# ---------------------------------------------------------------------------
# The bundled default catalog
# ---------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flare" / "catalogs"


def bundled_catalog(root: Path | None = None) -> Path:
    """The bundled model's catalog, captured on first use; concurrent starts capture it once."""
    root = root or cache_root()
    folder = root / f"{DEFAULT_RECIPE}-{_bundle_digest(ignition_root())}"
    root.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second server waits here, then finds the catalog written
        if not (folder / "catalog.yaml").is_file():
            _capture_bundled(folder)
    return folder


def ignition_root() -> Path:
    """The installed ``ignition`` folder, where the bundled recipe and weights lie.

    Found without importing it: capture and model code load only when a
    capture really runs (``_capture_bundled``).
    """
    spec = importlib.util.find_spec("ignition")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("the bundled model needs the ignition package, which is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _bundle_digest(package_root: Path) -> str:
    """Names the cache folder by what shapes the catalog: recipe, bundled weights, torch release, the
    catalog format (a new program contract captures afresh instead of finding a catalog it refuses), and
    the source that writes the programs (model code, capture, capacity planning, the captured ops), so a
    code change within one format version captures afresh instead of serving programs it no longer makes."""
    digest = hashlib.sha256(f"{torch.__version__.split('+')[0]} format {FORMAT_VERSION}".encode())
    for name, path in _bundle_inputs(package_root):
        digest.update(f"{name}\0{path.stat().st_size}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _bundle_inputs(package_root: Path) -> list[tuple[str, Path]]:
    """Every file the bundled capture reads, named relative to its package so the digest does not depend
    on where the packages are installed."""
    ops_root = Path(__file__).resolve().parent / "ops"
    files = [("recipe", package_root / "recipes" / f"{DEFAULT_RECIPE}.yaml")]
    files += _tree("weights", package_root / "models" / "bundled" / DEFAULT_RECIPE, ("*",))
    for part in ("models", "capture", "capacity", "components"):
        files += _tree(f"ignition/{part}", package_root / part, ("*.py",))
    files += _tree("helios/ops", ops_root, ("*.py", "*.cpp", "*.h"))
    return files


def _tree(name: str, folder: Path, patterns: tuple[str, ...]) -> list[tuple[str, Path]]:
    found = {path for pattern in patterns for path in folder.rglob(pattern)
             if path.is_file() and "__pycache__" not in path.parts}
    return [(f"{name}/{path.relative_to(folder).as_posix()}", path) for path in sorted(found)]


def _capture_bundled(folder: Path) -> None:
    from rich.console import Console

    from ignition.capture.pipeline import CaptureRequest, capture
    from ignition.capture.render import ProgressObserver

    log.info("capturing the bundled model into %s (first run only)", folder)
    observer = ProgressObserver(Console(stderr=True))
    try:
        capture(CaptureRequest(DEFAULT_RECIPE, folder, jobs=os.cpu_count() or 1), observer)
    finally:
        observer.close()
