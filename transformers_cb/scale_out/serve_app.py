"""The OpenAI app of `transformers-cb serve` as a Ray Serve deployment: N replicas, one manager each.

    from transformers_cb.scale_out.serve_app import build_app
    serve.run(build_app({"model": "/models/x", "num_replicas": 4, "num_gpus": 1}))
    # or: serve run transformers_cb.scale_out.serve_app:build_app model=/models/x num_replicas=4

Each replica loads the model and starts its manager exactly as `transformers-cb serve` does
(`serve/server.py` `build_state`, from the same options) and answers with the same FastAPI app
(`serve/app.py`), so every endpoint, error and stream is that of the one-process server. Ray Serve's
proxy routes each request to a replica; `/metrics` is the metrics of the replica that answered, and
every response names it in the `x-transformers-cb-replica` header. `transformers-cb serve
--ray-replicas N` runs this on a (local or given) cluster until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from ..jobs.inputs import InputError
from ..models.registry_model import TINY
from ..serve.server import DEFAULT_MODEL_NAME, add_serve_parser, build_state, drain
from . import require_ray_extra

REPLICA_HEADER = "x-transformers-cb-replica"
# build_app's own options; every other key is a `transformers-cb serve` option (`--max-batch-tokens` ->
# `max_batch_tokens`).
DEPLOYMENT_OPTIONS = ("num_replicas", "num_cpus", "num_gpus", "max_ongoing_requests", "name")


def serve_namespace(options: Mapping[str, object]) -> argparse.Namespace:
    """`transformers-cb serve`'s arguments from `options` (names as attributes, values typed or strings as
    `serve run ... key=value` gives them), parsed by the command's own parser: same types, same checks."""
    subparsers = argparse.ArgumentParser(prog="transformers-cb").add_subparsers()
    add_serve_parser(subparsers)
    parser = subparsers.choices["serve"]
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(set(options) - set(flags))
    if unknown:
        raise ValueError(f"unknown transformers-cb serve option(s) {unknown}; known: {sorted(flags)}")
    argv: list[str] = []
    for name, value in options.items():
        action = flags[name]
        if action.nargs == 0:  # a switch (--no-logprobs): given when true
            if str(value).lower() in ("1", "true", "yes"):
                argv.append(action.option_strings[0])
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    try:
        namespace = parser.parse_args(argv)
    except SystemExit:  # argparse printed the problem (e.g. "--dtype: invalid choice")
        raise ValueError(f"bad transformers-cb serve options: {dict(options)}") from None
    namespace.func = None  # the replica runs no command; the namespace only carries options
    return namespace


class ServeReplica:
    """One Serve replica: the manager of `serve/server.py` `build_state` and the app of `serve/app.py`."""

    def __init__(self, serve_options: dict[str, object]) -> None:
        from ray import serve

        self.args = serve_namespace(serve_options)
        self.state = build_state(self.args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> Any:
        from ..serve.app import build_openai_app

        app = build_openai_app(self.state)

        @app.middleware("http")
        async def name_the_replica(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = self.replica_id
            return response

        return app

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            drain(state.manager, self.args.shutdown_timeout)


def build_app(options: Mapping[str, Any] | None = None) -> Any:
    """A Ray Serve application of the OpenAI server (`serve run module:build_app key=value` style).

    `options`: `num_replicas` (default 1), `num_cpus` / `num_gpus` per replica (default 1 / 0),
    `max_ongoing_requests` per replica (default 256), `name` (the deployment's), and any
    `transformers-cb serve` option by its attribute name (`model`, `max_batch_tokens`, `seed`, ...)."""
    require_ray_extra("the Ray Serve deployment", ("ray", "ray.serve"))
    from ray import serve

    options = dict(options or {})
    deployment_options = {name: options.pop(name) for name in DEPLOYMENT_OPTIONS if name in options}
    serve_namespace(options)  # an unknown option fails here, not on every replica
    actor_options = {"num_cpus": float(deployment_options.get("num_cpus", 1))}
    if deployment_options.get("num_gpus"):
        actor_options["num_gpus"] = float(deployment_options["num_gpus"])
    # Given the class, `serve.deployment` returns the `Deployment` (its annotation is the decorator form's).
    deployment = cast(
        "serve.Deployment",
        serve.deployment(
            serve.ingress()(ServeReplica),
            name=deployment_options.get("name", "transformers-cb"),
            num_replicas=int(deployment_options.get("num_replicas", 1)),
            ray_actor_options=actor_options,
            max_ongoing_requests=int(deployment_options.get("max_ongoing_requests", 256)),
        ),
    )
    return deployment.bind(options)


def serve_options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The replicas' `transformers-cb serve` options from the command's arguments."""
    ignored = {
        "func",
        "command",
        "ray_replicas",
        "ray_address",
        "replica_cpus",
        "replica_gpus",
        "adaptive_threads",
    }
    return {name: value for name, value in vars(args).items() if name not in ignored}


def run_ray_serve(args: argparse.Namespace) -> int:
    """`transformers-cb serve --ray-replicas N`: serve on Ray until SIGINT / SIGTERM, then shut down."""
    try:
        require_ray_extra("transformers-cb serve --ray-replicas", ("ray", "ray.serve"))
    except ImportError as error:
        raise InputError(str(error)) from None
    if args.port == 0:
        raise InputError("--ray-replicas needs a fixed --port: Ray Serve's proxy cannot pick a free one")
    import ray
    from ray import serve

    from .batch_job import ray_session

    options = {
        **serve_options_of(args),
        "num_replicas": args.ray_replicas,
        "num_cpus": args.replica_cpus,
        "num_gpus": args.replica_gpus,
    }
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ray_session(args.ray_address):
            serve.start(http_options={"host": args.host, "port": args.port})
            try:
                serve.run(build_app(options), name="transformers-cb", route_prefix="/", blocking=False)
                name = args.served_model_name or (
                    Path(args.model).name if args.model not in (None, TINY) else DEFAULT_MODEL_NAME
                )
                print(
                    f"transformers-cb serve: {name} on http://{args.host}:{args.port} "
                    f"({args.ray_replicas} Ray Serve replicas)",
                    flush=True,
                )
                stop.wait()
            finally:
                serve.shutdown()
    except ray.exceptions.RayError as error:
        raise InputError(f"cannot start the Ray Serve app: {error}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("transformers-cb serve: stopped", file=sys.stderr, flush=True)
    return 0
