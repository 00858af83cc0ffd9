"""``--debug`` on every command that turns errors into one line: listed by ``--help`` (before and
after a subcommand), and it brings the traceback back, the underlying error's included."""

from __future__ import annotations

import pytest

from bench import cli as bench_cli
from offload import checkpoint
from offload.infer import cli as generate_cli


@pytest.mark.parametrize("main, argv", [
    (checkpoint.main, ["--help"]),
    (checkpoint.main, ["consolidate", "--help"]),
    (generate_cli.main, ["--help"]),  # python -m offload.generate
    (bench_cli.main, ["--help"]),
    *[(bench_cli.main, [command, "--help"]) for command in ("validate", "run", "sweep", "fio")],
])
def test_help_lists_debug(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--debug" in out and "show the traceback" in out and "OFFLOAD_DEBUG=1" in out


def test_debug_after_the_subcommand_raises_the_error_with_its_traceback(capsys):
    """The flag the subcommand's help lists works there too: the error is raised, not printed as one line."""
    with pytest.raises(FileNotFoundError):
        checkpoint.main(["consolidate", "/nonexistent-checkpoint", "/tmp/out", "--debug"])


def test_bench_errors_are_one_line_and_debug_shows_the_cause(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OFFLOAD_DEBUG", raising=False)
    missing = tmp_path / "missing.json"
    argv = ["run", str(tmp_path), "--config", str(missing)]
    assert bench_cli.main(argv) == bench_cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() == f"tensorio-bench run: error: --config {missing}: no such file"
    with pytest.raises(bench_cli.CliError) as raised:
        bench_cli.main([*argv, "--debug"])
    assert isinstance(raised.value.__context__, FileNotFoundError) and not raised.value.__suppress_context__
    monkeypatch.setenv("OFFLOAD_DEBUG", "1")
    with pytest.raises(bench_cli.CliError):
        bench_cli.main(argv)
