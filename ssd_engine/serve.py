"""CLI: python -m ssd_engine.serve [--port 8000] [engine options]

An OpenAI-compatible server (FastAPI + uvicorn) on the built-in pair in SSD mode unless --model /
--speculative-mode say otherwise; every engine option of `python -m ssd_engine.generate` applies."""

import importlib.util
import os
import sys

from ssd_engine.cli_args import (
    ArgumentParser,
    add_engine_args,
    describe_engine,
    engine_options,
    fail,
)
from ssd_engine.core.sampling_params import DEFAULTS_RULE, MODEL_DEFAULT_FIELDS, SamplingParams
from ssd_engine.server.auth import ENV_VAR, KEY_FLAG, access_line, resolve_keys

# the `serve` extra; checked after parsing so that --help works on an install without it
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
SERVE_INSTALL = 'pip install "ssd_engine[serve]"'


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m ssd_engine.serve",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="Sampling: a request's " + DEFAULTS_RULE + ". A request without max_tokens gets 16 "
        "tokens on /v1/completions and up to max_model_len on /v1/chat/completions "
        "(max_completion_tokens, its newer name, wins over max_tokens), as in vLLM. "
        "Ctrl-C drains the requests in flight; a second Ctrl-C stops at once.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=8000, help="0 picks a free port (printed at start)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the folder name)",
    )
    parser.add_argument(
        "--max-pending", type=int, default=256, help="requests in flight beyond this get a 503"
    )
    parser.add_argument(
        KEY_FLAG,
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="every request but /health and /metrics must carry 'Authorization: Bearer KEY', else a "
        "401; one key or more (as in vLLM: --api-key K1 K2; the flag may also be repeated). "
        f"Without it, {ENV_VAR} if set (one key or several, comma-separated, kept out of the "
        "process list), as vLLM's VLLM_API_KEY",
    )
    parser.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the API key too (default: open to scrapers, as /health is to probes)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="N",
        help="N engine replicas behind this endpoint, each on its own share of the cores, on Ray "
        "Serve (pip install -e '.[ray]'); requests go to the replica with the shorter queue",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --data-parallel-size: join this Ray cluster (e.g. 'auto' or HOST:6379) and let it "
        "place the replicas on its nodes, instead of starting a local one",
    )
    add_engine_args(parser)
    return parser


def missing_server_packages() -> list[str]:
    """All of them at once, so one reinstall fixes the lot."""
    return [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]


def describe_sampling(llm) -> str:
    """The `[sampling]` line: what a request's unset sampling fields take, and where that comes from."""
    defaults = llm.get_default_sampling_params()
    values = " ".join(f"{name}={getattr(defaults, name)}" for name in MODEL_DEFAULT_FIELDS)
    plain = SamplingParams()
    from_model = [
        name for name in MODEL_DEFAULT_FIELDS if getattr(defaults, name) != getattr(plain, name)
    ]
    source = (
        f"{', '.join(from_model)} from the model's generation_config.json"
        if from_model
        else "SamplingParams' defaults; the model's generation_config.json changes none"
    )
    return f"[sampling] unset fields take {values} ({source}; temperature=0 is greedy)"


def draining_server(uvicorn, config, async_engine):
    """uvicorn's Server, which on a first Ctrl-C stops accepting and waits for the requests in flight, saying
    so in one line (a second Ctrl-C is uvicorn's force exit)."""

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            n = async_engine.in_flight
            if n and not self.force_exit:
                print(
                    f"[serve] stopping: draining {n} in-flight request{'s' if n != 1 else ''} first "
                    "(Ctrl-C again to stop now)",
                    file=sys.stderr,
                    flush=True,
                )
            await super().shutdown(sockets=sockets)

    return DrainingServer(config)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        api_keys = resolve_keys(args.api_key, os.environ)
    except ValueError as error:  # names the flag or variable, never the key
        fail(str(error))
    if args.metrics_require_key and api_keys is None:
        fail(f"--metrics-require-key needs an API key: {KEY_FLAG} KEY or {ENV_VAR}")
    # before the model loads: a missing package should cost the user seconds, not a model load
    missing = missing_server_packages()
    if missing:
        fail(f"python -m ssd_engine.serve needs {', '.join(missing)}: {SERVE_INSTALL}")
    try:
        import uvicorn

        from ssd_engine.server.async_engine import AsyncEngine
        from ssd_engine.server.openai_api import build_app, open_paths
    except ImportError as error:  # installed but unimportable (e.g. a dependency of theirs)
        fail(f"python -m ssd_engine.serve cannot import {error.name or error}: {SERVE_INSTALL}")
    from ssd_engine import LLM

    if args.data_parallel_size < 1:
        fail(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 or args.ray_address:
        serve_on_ray(args, api_keys)
        return
    try:
        # built on the thread that will step it (server/async_engine.py says why)
        async_engine = AsyncEngine.build(
            lambda: LLM(**engine_options(args)), max_pending=args.max_pending
        )
        llm = async_engine.llm
        sampling = describe_sampling(llm)
    except ValueError as error:
        fail(str(error))
    except KeyboardInterrupt:  # while loading: children started so far die with this process
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    name = served_name(args, llm.config.model.path)
    print(describe_engine(llm), file=sys.stderr)
    print(sampling, file=sys.stderr, flush=True)
    access = access_line(args.host, api_keys, open_paths(args.metrics_require_key))
    if access:
        print(access, file=sys.stderr, flush=True)
    app = build_app(
        async_engine, name, api_keys=api_keys, metrics_require_key=args.metrics_require_key
    )
    server = draining_server(
        uvicorn, uvicorn.Config(app, host=args.host, port=args.port, log_level="info"), async_engine
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises again the Ctrl-C it handled, once it has stopped
        pass
    finally:
        async_engine.close()
        llm.close()
    if not server.started:
        # uvicorn said why (the port is taken, ...); its own exit status for a failed start
        sys.exit(3)


def served_name(args, model: str | None) -> str:
    """The model id clients send: --served-model-name, else the target folder's name (the built-in pair's
    when no model is given)."""
    if args.served_model_name:
        return args.served_model_name
    if model is None:
        from ssd_engine.models.default_models import resolve_default_model

        model = resolve_default_model("target")
    return os.path.basename(os.path.normpath(model))


def serve_on_ray(args, api_keys) -> None:
    """--data-parallel-size N: the replicas on Ray Serve (server/replicas.py)."""
    from ssd_engine import LLM
    from ssd_engine.server.replicas import serve_replicas

    options = engine_options(args)
    try:
        serve_replicas(
            args.data_parallel_size,
            LLM,
            describe_engine,
            options,
            served_name(args, options.get("model")),
            args.host,
            args.port,
            api_keys,
            args.metrics_require_key,
            args.max_pending,
            args.ray_address,
        )
    except ValueError as error:
        fail(str(error))


if __name__ == "__main__":
    main()
