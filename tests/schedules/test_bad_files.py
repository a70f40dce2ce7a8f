"""A corpus of bad schedule files for `pipeplan schedule --load`: each one is refused with exit 2,
one line naming the file, no traceback, and work bounded by the file's size (time and memory)."""
import time
import tracemalloc

import pytest

from pipeplan.cli import build_parser, main

CORPUS = {
    "deep.json": ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    "deep_object.json": ('{"a":' * 50_000 + "1" + "}" * 50_000, "nested deeper than"),
    "huge_mb.json": ('{"ranks":1,"stages":1,"microbatches":100000000,"stage_to_rank":[0],"order":[[]]}',
                     "needs at least 200000000 actions"),
    "float_mb.json": ('{"ranks":1,"stages":1,"microbatches":1e9,"stage_to_rank":[0],"order":[[]]}',
                      "'microbatches' must be an integer"),
    "ranks_mismatch.json": ('{"ranks":1000000000,"stages":1,"microbatches":1,"stage_to_rank":[0],'
                            '"order":[[{"op":"F","stage":0,"mb":0},{"op":"BW","stage":0,"mb":0}]]}',
                            "'ranks' is 1000000000 but 'order' lists 1 ranks"),
    "long_int.json": ('{"ranks":' + "9" * 5000 + "}", "malformed schedule JSON"),
    "utf16.json": ('{"ranks": 1}'.encode("utf-16"), "not a UTF-8 text file"),
    "latin1.csv": (b"0F0,0B0 \xe9\n", "not a UTF-8 text file (byte 8 is 0xe9)"),
    "far_stage.csv": ("0F0,999999999F0", "stage 1 has no actions"),
    "far_mb.csv": ("0F0,0B0,0F999999999", "out of range"),
    "long_number.csv": ("0F" + "9" * 5000, "more than 12 digits"),
    "garbage.csv": ("hello,world\n", "is not {stage}{F|I|W|B}{microbatch}"),
    "empty.csv": ("\n\n", "no rows"),
    "deadlock.csv": ("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", "deadlock"),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_bad_schedule_file_is_refused_naming_the_file(name, tmp_path, capsys):
    content, message = CORPUS[name]
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    build_parser()  # the CLI's imports, outside the measurement
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        code = main(["schedule", "--load", str(path)])
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(str(path) + ": ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # bounded by the file: a few times its size plus the interpreter's constant overhead
    assert peak < 20 * path.stat().st_size + 20_000_000, peak
    assert elapsed < 10, elapsed  # a hang guard, not a benchmark (the bad inputs used to take 40 s)


def test_many_ranks_load_in_linear_time(tmp_path, capsys):
    """20,000 ranks (one stage each) load, verify and simulate; the bound is linear in ranks."""
    path = tmp_path / "wide.csv"
    path.write_text("".join(f"{r}F0,{r}B0\n" for r in range(20_000)))
    t0 = time.perf_counter()
    assert main(["schedule", "--load", str(path), "-o", str(tmp_path / "out.txt")]) == 0
    assert time.perf_counter() - t0 < 30  # quadratic took minutes under load; linear takes ~2 s
    assert (tmp_path / "out.txt").read_text().startswith("schedule")
