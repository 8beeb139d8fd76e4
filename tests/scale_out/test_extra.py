"""Without the `ray` extra, `generate --ray` and `serve --ray-replicas` stop with a message naming it."""

from __future__ import annotations

import sys

import pytest

from transformers_cb.cli.main import EXIT_BAD_INPUT, main
from transformers_cb.scale_out import RAY_INSTALL_HINT, missing_ray_modules, require_ray_extra


@pytest.fixture
def without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import ray` fail and find_spec report it missing, whether or not it is installed.
    for name in ("ray", "ray.data", "ray.serve"):
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_modules_are_named(without_ray) -> None:
    assert missing_ray_modules() == ["ray", "ray.data", "ray.serve"]
    with pytest.raises(ImportError, match=r"batch jobs needs the optional 'ray' extra \(ray, ray.data,"):
        require_ray_extra("batch jobs")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--ray", "--replicas", "2", "--input", "-"],
        ["serve", "--ray-replicas", "2", "--port", "8000"],
    ],
)
def test_commands_name_the_extra(without_ray, argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "optional 'ray' extra" in err and RAY_INSTALL_HINT in err


def test_serve_options_parse_like_the_command() -> None:
    from transformers_cb.cli.main import build_parser
    from transformers_cb.scale_out.serve_app import serve_namespace, serve_options_of

    # `serve run ...:build_app key=value` gives strings; a RayService YAML gives typed values. A model left
    # unset (None) is the command's default one.
    namespace = serve_namespace({"page_size": "16", "no_logprobs": "true", "seed": 3, "model": None})
    assert (namespace.page_size, namespace.no_logprobs, namespace.seed, namespace.model) == (
        16,
        True,
        3,
        "smollm2",
    )
    with pytest.raises(ValueError, match=r"unknown transformers-cb serve option\(s\) \['bogus'\]"):
        serve_namespace({"bogus": 1})
    with pytest.raises(ValueError, match="bad transformers-cb serve options"):
        serve_namespace({"dtype": "int8"})
    # What `serve --ray-replicas` hands its replicas is exactly the command's own options.
    args = build_parser().parse_args(
        ["serve", "--ray-replicas", "2", "--max-batch-tokens", "64", "--no-logprobs"]
    )
    replica = serve_namespace(serve_options_of(args))
    assert (replica.max_batch_tokens, replica.no_logprobs, replica.port) == (64, True, 8000)
