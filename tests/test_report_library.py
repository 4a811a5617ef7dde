"""The report as one library call: ``replay.write_report`` does what ``router-replay report`` does.

The library's refusals name parameters where the command names flags, both refuse before any
page is written, and the page the library writes is the command's, byte for byte (the build
time stamp aside).
"""

from __future__ import annotations

import re

import pytest
from test_nothing_lost import invoke, ok, refused

import replay
from replay.errors import NeedsForce, ParamError, ParamsError


@pytest.fixture(scope="module")
def run(gen_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("report-lib") / "run"
    ok(invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "2,4", "--no-report", "-q"))
    return out


def _page(path) -> str:
    # the page records when it was built; everything else is the run's
    return re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z| UTC)?", "TIME", path.read_text())


def test_the_library_names_parameters_where_the_command_names_flags(run, tmp_path):
    with pytest.raises(ParamError) as err:
        replay.write_report(run, max_p99_waiting=float("nan"))
    assert err.value.param == "max_p99_waiting" and str(err.value).startswith("max_p99_waiting must be")
    refused(invoke("report", run, "--max-p99-waiting", "nan"), "--max-p99-waiting must be")

    with pytest.raises(ParamsError) as both:
        replay.write_report(run, max_ttft_p99_ms=100.0, max_queue_wait_p99_ms=10.0)
    assert str(both.value) == "give one of max_ttft_p99_ms and max_queue_wait_p99_ms"
    refused(invoke("report", run, "--max-ttft-p99-ms", "100", "--max-queue-wait-p99-ms", "10"),
            "give one of --max-ttft-p99-ms and --max-queue-wait-p99-ms")
    assert not (run / "report.html").exists()

    elsewhere = tmp_path / "page.html"
    elsewhere.write_text("<title>router-replay report: old</title>")
    with pytest.raises(NeedsForce, match="force=True"):
        replay.write_report(run, elsewhere)
    refused(invoke("report", run, "--out", elsewhere), "--force")
    assert elsewhere.read_text() == "<title>router-replay report: old</title>"


def test_the_library_writes_the_command_s_page(run, tmp_path):
    lib = replay.write_report(run, tmp_path / "lib.html", config_id=1)
    ok(invoke("report", run, "--out", tmp_path / "cli.html", "--config", "1", "-q"))
    assert lib == tmp_path / "lib.html"
    assert _page(lib) == _page(tmp_path / "cli.html")
    # the run's own page is rebuilt without force, by both
    own = replay.write_report(run)
    assert own == run / "report.html" and own.is_file()
    ok(invoke("report", run, "-q"))
