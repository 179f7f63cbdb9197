"""CLI: python -m ssd_engine.serve [--port 8000] [engine options]

An OpenAI-compatible server (FastAPI + uvicorn) on the built-in pair in SSD mode unless --model /
--speculative-mode say otherwise. Every engine option of `python -m ssd_engine.generate` applies.
"""
import importlib.util
import os

from ssd_engine.cli_args import ArgumentParser, add_engine_args, engine_options, fail

# the `serve` extra; checked after parsing so that --help works on an install without it
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
SERVE_INSTALL = 'pip install "ssd_engine[serve]"'


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ssd_engine.serve", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    parser.add_argument("--max-pending", type=int, default=256, help="requests in flight beyond this get a 503")
    add_engine_args(parser)
    return parser


def missing_server_packages() -> list[str]:
    """All of them at once, so one reinstall fixes the lot."""
    return [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # before the model loads: a missing package should cost the user seconds, not a model load
    missing = missing_server_packages()
    if missing:
        fail(f"python -m ssd_engine.serve needs {', '.join(missing)}: {SERVE_INSTALL}")
    try:
        import uvicorn
        from ssd_engine.server.async_engine import AsyncEngine
        from ssd_engine.server.openai_api import build_app
    except ImportError as error:  # installed but unimportable (e.g. a dependency of theirs)
        fail(f"python -m ssd_engine.serve cannot import {error.name or error}: {SERVE_INSTALL}")
    from ssd_engine import LLM

    try:
        llm = LLM(**engine_options(args))
    except ValueError as error:
        fail(str(error))
    if llm.config.model is None:  # the built-in pair
        from ssd_engine.models.default_models import resolve_default_model
        model_path = resolve_default_model("target")
    else:
        model_path = llm.config.model
    name = args.served_model_name or os.path.basename(os.path.normpath(model_path))
    engine = AsyncEngine(llm, max_pending=args.max_pending)
    try:
        uvicorn.run(build_app(engine, name), host=args.host, port=args.port, log_level="info")
    finally:
        engine.close()
        llm.close()


if __name__ == "__main__":
    main()
