"""CLI: python -m ssd_engine.serve [--port 8000] [engine options]

An OpenAI-compatible server (FastAPI + uvicorn) on the built-in pair in SSD mode unless --model /
--speculative-mode say otherwise. Every engine option of `python -m ssd_engine.generate` applies.
"""
import os

from ssd_engine.cli_args import ArgumentParser, add_engine_args, engine_options, fail


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ssd_engine.serve", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    parser.add_argument("--max-pending", type=int, default=256, help="requests in flight beyond this get a 503")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from ssd_engine import LLM
    from ssd_engine.server.async_engine import AsyncEngine
    from ssd_engine.server.openai_api import build_app

    args = build_parser().parse_args(argv)
    try:
        llm = LLM(**engine_options(args))
    except ValueError as error:
        fail(str(error))
    if llm.config.model is None:  # the built-in pair
        from ssd_engine.default_models import resolve_default_model
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
