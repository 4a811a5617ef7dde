"""The CLI's start and end: a command imports only what it uses, and a finished
sweep or report ends without the interpreter's teardown, having written and flushed everything.

Real processes (the console script and ``python -c``), real traces and run directories.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.trace.synthetic import generate_trace

REPO = Path(__file__).resolve().parent.parent
CONSOLE = shutil.which("router-replay") or os.path.join(os.path.dirname(sys.executable), "router-replay")
GRID = ["--worker-queue-limit", "none,2,4", "--saturation-queue-floor", "none,1,2"]


def _imported_after(code: str) -> list[str]:
    heavy = ("numba", "polars", "pyarrow", "plotly", "scipy", "replay.sweep.engine", "replay.simulate", "replay.trace")
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {heavy!r} if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    return res.stdout.split()


def test_start_imports_only_what_the_command_uses():
    """``import replay``, the CLI's command tree and ``--help`` load none of the heavy libraries;
    the public names still resolve (on first use)."""
    assert _imported_after("import replay") == []
    assert _imported_after("import replay.cli") == []
    assert _imported_after("from click.testing import CliRunner\nfrom replay.cli import main\n"
                           "r = CliRunner().invoke(main, ['--help'])\nassert r.exit_code == 0, r.output\n"
                           "r = CliRunner().invoke(main, ['sweep', '--help'])\nassert r.exit_code == 0") == []
    import replay

    for name in replay.__all__:
        assert getattr(replay, name) is not None, name
    with pytest.raises(AttributeError):
        _ = replay.no_such_name


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("start") / "trace"
    generate_trace(d, n_requests=1200, n_workers=6, dp_size=2, sample_interval_ms=100, max_matches=6, seed=4)
    return d


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


# a process that runs the CLI as the console script does (main() reading sys.argv), with an
# atexit handler and an object whose finalizer runs only in the interpreter's teardown
PROBE = """
    import atexit, sys
    marks = sys.argv.pop(1)
    atexit.register(lambda: open(marks + ".atexit", "w").write("ran"))
    class Teardown:
        def __del__(self, _open=open, _path=marks + ".teardown"):
            _open(_path, "w").write("ran")
    keep = Teardown()
    from replay.cli import main
    sys.argv = ["router-replay"] + sys.argv[1:]
    main()
"""


def test_finished_sweep_skips_only_the_teardown(trace, tmp_path):
    """The sweep's process ends with everything written (run dir, report, the last stdout line),
    exit 0, atexit handlers run, and the outputs equal an in-process run's; only the teardown is
    skipped.  A failing command still exits the ordinary way."""
    out, marks = tmp_path / "run", tmp_path / "m"
    p = _python(PROBE, str(marks), "sweep", str(trace), "--out", str(out), *GRID)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n").splitlines()[-1] == f"report: {out / 'report.html'} (open it in a browser)"
    assert (tmp_path / "m.atexit").read_text() == "ran"
    assert not (tmp_path / "m.teardown").exists()
    assert (out / "report.html").read_text(encoding="utf-8").endswith("</html>\n")
    again = tmp_path / "again"
    res = CliRunner().invoke(main, ["sweep", str(trace), "--out", str(again), *GRID])
    assert res.exit_code == 0, res.output
    for name in ("summary.parquet", "decisions.parquet", "fleet.parquet"):
        assert pl.read_parquet(out / name).equals(pl.read_parquet(again / name)), name
    # the report command, through the console script
    p = subprocess.run([CONSOLE, "report", str(out), "--out", str(tmp_path / "r.html")], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and p.stdout == f"wrote {tmp_path / 'r.html'}\n", p.stderr
    assert (tmp_path / "r.html").read_text(encoding="utf-8").endswith("</html>\n")
    # an error: exit 2 and the ordinary exit (teardown included)
    bad = tmp_path / "bad"
    p = _python(PROBE, str(bad), "sweep", str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and p.stderr.startswith("error: "), p.stderr
    assert (tmp_path / "bad.atexit").exists() and (tmp_path / "bad.teardown").exists()


def test_sweep_imports_no_pyarrow_compute(trace, tmp_path):
    """A sweep (decisions and report written) imports neither ``pyarrow.compute`` nor
    ``pyarrow.dataset`` (about 0.1-0.3 s of a start)."""
    out = tmp_path / "run"
    p = _python("""
        import sys
        from replay.cli import main
        try:
            main.main(sys.argv[1:], standalone_mode=False)
        finally:
            print(' '.join(m for m in ('pyarrow.compute', 'pyarrow.dataset') if m in sys.modules), 'end')
    """, "sweep", str(trace), "--out", str(out), "-q", *GRID)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["end"], p.stdout
    assert (out / "report.html").exists() and (out / "decisions.parquet").exists()
