"""`serve --data-parallel-size N`: N engine replicas behind one OpenAI endpoint, on Ray Serve. Each
replica builds its engine on core set r (its rank) and runs the one-engine app; an ingress relays
each request (relay.py) to a replica with a short queue, queueing up to `--max-pending` past every
replica's `max_num_seqs`, 503 beyond. Nothing here imports ray until N > 1 asks for it."""

import signal
import sys
import threading
from collections.abc import Callable

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.core_sets import format_core_sets, parse_core_sets
from ssd_engine.distributed.placement import available_cores, split_evenly
from ssd_engine.server import replica_metrics
from ssd_engine.server.relay import HttpRequest, relay, run_app

RAY_INSTALL = 'pip install -e ".[ray]"'
APP_NAME = "ssd_engine"


class EngineReplica:
    """One replica: an engine on its core set, and the OpenAI app in front of it."""

    def __init__(
        self,
        make_llm: Callable[..., object],
        describe: Callable[[object], str],
        options: dict,
        core_sets: list[list[int]] | None,
        served_name: str,
        api_keys,
        metrics_require_key: bool,
        max_pending: int,
        board,
    ) -> None:
        from ray import serve

        from ssd_engine.server.async_engine import AsyncEngine
        from ssd_engine.server.openai_api import build_app

        rank = serve.get_replica_context().rank.rank
        if core_sets is not None:
            options = {**options, "cpu_cores": format_core_sets([core_sets[rank % len(core_sets)]])}
        self.async_engine = AsyncEngine.build(lambda: make_llm(**options), max_pending=max_pending)

        # /metrics, wherever the scrape lands: the board's merge
        async def every_replicas_metrics() -> bytes:
            return await board.render.remote()

        self.app = build_app(
            self.async_engine,
            served_name,
            api_keys=api_keys,
            metrics_require_key=metrics_require_key,
            every_replicas_metrics=every_replicas_metrics,
        )
        self.stop_pushing = threading.Event()
        replica_metrics.push_forever(board, rank, self.app.state.own_metrics, self.stop_pushing)
        print(f"[replica {rank}] {describe(self.async_engine.llm)}", file=sys.stderr, flush=True)

    async def forward(self, request: HttpRequest):
        """The app's response to `request`: its head, then its body in the pieces the app sends."""
        async for piece in run_app(self.app, request):
            yield piece

    def __del__(self) -> None:
        if hasattr(self, "stop_pushing"):
            self.stop_pushing.set()
        async_engine = getattr(self, "async_engine", None)
        if async_engine is not None:
            async_engine.close()
            async_engine.llm.close()


class Ingress:
    """The endpoint's one deployment before the replicas: every request relayed to one of them."""

    def __init__(self, engines) -> None:
        self.engines = engines  # the replicas' deployment handle

    async def __call__(self, request):
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import StreamingResponse

        from ssd_engine.server.openai_api import error

        http = HttpRequest(
            request.method,
            request.url.path,
            request.url.query.encode(),
            list(request.headers.raw),
            await request.body(),
        )
        try:
            head, body = await relay(
                lambda: self.engines.options(stream=True).forward.remote(http),
                lambda failure: isinstance(failure, RayActorError),
            )
        except BackPressureError:
            return error(
                503,
                "every replica is busy and the queue is full (--max-pending)",
                kind="server_overloaded",
                code="overloaded",
            )
        response = StreamingResponse(body, status_code=head.status)
        # the replica's, content-length and content-type included
        response.raw_headers = head.headers
        return response


def replica_core_sets(replicas: int, cpu_cores: str | None = None) -> list[list[int]]:
    """Replica r's cores: the r-th set of `cpu_cores` where it names one per replica, else the r-th of
    an even split of its cores (default: this process's)."""
    sets = parse_core_sets(cpu_cores) if cpu_cores else [available_cores()]
    if len(sets) == replicas:
        return sets
    cores = sorted({c for s in sets for c in s})
    if len(cores) < replicas:
        raise ValueError(
            f"--data-parallel-size {replicas} needs a core per replica; {len(cores)} core(s) "
            f"{cores} are given"
        )
    return split_evenly(cores, replicas)


def serve_replicas(
    replicas: int,
    make_llm: Callable[..., object],
    describe: Callable[[object], str],
    options: dict,
    served_name: str,
    host: str,
    port: int,
    api_keys,
    metrics_require_key: bool,
    max_pending: int,
    ray_address: str | None,
) -> None:
    """Start (or join, with `ray_address`) a Ray cluster, run the replicas behind host:port until
    Ctrl-C or SIGTERM, then stop them and the cluster this call started. Each replica builds its
    engine with `make_llm(**options)` (options with its cores) and prints `describe(llm)`; both are
    sent to the replicas by reference (module-level names)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(
            f"--data-parallel-size {replicas} runs on Ray Serve, which is not installed: "
            f"{RAY_INSTALL}"
        ) from None
    # bad options fail here, before Ray starts
    max_num_seqs = EngineConfig.from_kwargs(**options).scheduler.max_num_seqs
    core_sets = None if ray_address else replica_core_sets(replicas, options.get("cpu_cores"))
    if ray_address:
        ray.init(address=ray_address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=sum(len(s) for s in core_sets),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"SSD_ENGINE_PROGRESS": "0"}},
        )
    try:
        serve.start(http_options={"host": host, "port": port})
        per_replica = len(core_sets[0]) if core_sets else 1
        engines = serve.deployment(
            EngineReplica,
            name="engine",
            num_replicas=replicas,
            max_ongoing_requests=max_num_seqs,
            max_queued_requests=max_pending,
            ray_actor_options={"num_cpus": per_replica},
        )
        # the ingress holds every request the replicas run or queue; it computes nothing (no CPU of its own)
        ingress = serve.deployment(
            Ingress,
            name="ingress",
            max_ongoing_requests=replicas * max_num_seqs + max_pending,
            ray_actor_options={"num_cpus": 0},
        )
        # every replica's metrics meet here for /metrics (server/replica_metrics.py); no CPU of its own
        board = ray.remote(replica_metrics.MetricsBoard).options(num_cpus=0).remote()
        serve.run(
            ingress.bind(
                engines.bind(
                    make_llm,
                    describe,
                    options,
                    core_sets,
                    served_name,
                    api_keys,
                    metrics_require_key,
                    max_pending,
                    board,
                )
            ),
            name=APP_NAME,
            route_prefix="/",
            blocking=False,
        )
        print(
            f"[serve] {replicas} replicas on Ray Serve at http://{host}:{port}"
            + (
                f" (cores {format_core_sets(core_sets)})"
                if core_sets
                else f" (cluster {ray_address})"
            ),
            file=sys.stderr,
            flush=True,
        )
        _wait_for_stop()
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_for_stop() -> None:
    """Until Ctrl-C or SIGTERM (both end as KeyboardInterrupt here, so the caller cleans up). Both
    handlers are set, as uvicorn sets them for one engine: a process started in the background
    inherits SIGINT ignored, and Python then installs no handler of its own."""

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("[serve] stopping the replicas", file=sys.stderr, flush=True)
