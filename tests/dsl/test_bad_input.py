"""A corpus of bad plans: each is refused by `pipeplan check` with exit 2, at a plan location
(file:line:col and a caret), without a traceback, in bounded time and memory.

Every plan and model file is written here into tmp_path; the whole corpus runs in one
child process (tests/bad_input.py) under an address-space limit and a timeout.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPT = str(REPO / "examples/models/gpt.py") + ":GPT"

GOOD = """\
model {{
  source = "{source}"
  args = {{ vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8 }}
  capture = fx{model_extra}
}}
data = synthetic(vocab = 32, seq_len = 8{data_extra})
mesh {{ pp = {pp} }}
pipeline {{ schedule = {schedule}  microbatches = {microbatches}{pipeline_extra} }}
train {{ steps = 2  global_batch = {batch} }}
{extra}"""


def plan_text(source=GPT, model_extra="", data_extra="", pp=2, schedule="1f1b", microbatches=2,
              pipeline_extra="", batch=4, extra="") -> str:
    return GOOD.format(source=source, model_extra=model_extra, data_extra=data_extra, pp=pp,
                       schedule=schedule, microbatches=microbatches,
                       pipeline_extra=pipeline_extra, batch=batch, extra=extra)


EXIT_AT_IMPORT = "import sys\nsys.exit(3)\n"
ARGV_AT_IMPORT = ("import argparse\np = argparse.ArgumentParser()\n"
                  "p.add_argument('--lr', type=float, required=True)\nARGS = p.parse_args()\n")
TOKENS_MODEL = (f"import sys\nsys.path.insert(0, {str(REPO.parent)!r})\n"
                "from pipeplan.examples.models.gpt import GPT\n"
                "class TokensGPT(GPT):\n"
                "    def forward(self, tokens):\n"
                "        return super().forward(tokens)\n")

# name -> (plan bytes or text, what the message says, model files to write)
CASES = {
    "latin-1 byte": (plan_text().replace("capture = fx", "capture = fx  # caf\xe9").encode("latin-1"),
                     "is not UTF-8", {}),
    "utf-16 with BOM": (plan_text().encode("utf-16"), "UTF-16", {}),
    "utf-16 without BOM": (plan_text().encode("utf-16-le"), "UTF-16", {}),
    "model exits at import": (plan_text(source="exits.py:Net"), "calls sys.exit(3) at import",
                              {"exits.py": EXIT_AT_IMPORT}),
    "model parses argv at import": (plan_text(source="argv.py:Net"),
                                    "parses command-line arguments at import",
                                    {"argv.py": ARGV_AT_IMPORT}),
    "recompute pattern matches nothing": (plan_text(extra="recompute { blocks.*.mlp = full }\n"),
                                          "recompute pattern 'blocks.*.mlp' matches no module", {}),
    "leaf pattern matches nothing": (plan_text(model_extra="\n  leaf_modules = [layers.*.attnn]"),
                                     "leaf_modules pattern 'layers.*.attnn' matches no module", {}),
    "input the forward does not take": (
        plan_text(model_extra="\n  inputs = { input_ids = int64[batch, seq], "
                              "mask = bool[batch, seq] }", data_extra=", inputs = { mask = mask }"),
        "model input 'mask' is not a parameter of GPT.forward", {}),
    "forward input the plan does not give": (plan_text(source="tokens_gpt.py:TokensGPT"),
                                             "model input 'input_ids' is not a parameter",
                                             {"tokens_gpt.py": TOKENS_MODEL}),
    "input without a data field": (
        plan_text(source="tokens_gpt.py:TokensGPT",
                  model_extra="\n  inputs = { tokens = int64[batch, seq], pos = int64[batch, seq] }"),
        "model input 'pos' has no data field", {"tokens_gpt.py": TOKENS_MODEL}),
    "data feeds a name that is no input": (plan_text(data_extra=", inputs = { ids = tokens }"),
                                           "data feeds 'ids', which is not among model.inputs", {}),
    "float input from tokens": (plan_text(model_extra="\n  inputs = { input_ids = float32[batch, seq] }"),
                                "reads tokens (integers) but is declared float32", {}),
    "microbatches 10**12": (plan_text(microbatches=10**12, batch=2 * 10**12), "must be at most", {}),
    "5000-digit integer": (plan_text(microbatches="1" + "0" * 5000), "is too large", {}),
    "schedule too long": (plan_text(pp=64, schedule="interleaved", microbatches=8192, batch=8192,
                                    pipeline_extra="  virtual = 2"),
                          "forwards, above", {}),
    "step reads too many tokens": (plan_text(batch=2**24).replace("seq_len = 8)", "seq_len = 4096)"),
                                   "tokens, above", {}),
    "too many ranks": (plan_text().replace("mesh { pp = 2 }", "mesh { pp = 2  dp = 40000 }"),
                       "ranks is above", {}),
    "synthetic vocab 10**9": (plan_text().replace("synthetic(vocab = 32", "synthetic(vocab = 1000000000"),
                              "data.vocab must be at most", {}),
    "huge layer range": (plan_text(pipeline_extra="  split = [layers[0:1], layers[1:99999999]]"),
                         "has a bound above", {}),
    "input named targets": (
        plan_text(model_extra="\n  inputs = { input_ids = int64[batch, seq], targets = int64[batch, seq] }",
                  data_extra=", inputs = { targets = targets }"),
        "may not be named 'targets'", {}),
}


def run_corpus(tmp_path: Path, cases: dict, argv_of) -> dict:
    specs = []
    for i, (name, (content, _, files)) in enumerate(cases.items()):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        for file, body in files.items():
            path = folder / file
            path.write_bytes(body) if isinstance(body, bytes) else path.write_text(body)
        plan = folder / "bad.plan"
        (plan.write_bytes if isinstance(content, bytes) else plan.write_text)(content)
        specs.append({"name": name, "argv": argv_of(plan)})
    (tmp_path / "cases.json").write_text(json.dumps(specs))
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, str(REPO / "tests/bad_input.py"), str(tmp_path / "cases.json"),
                    str(out)], timeout=240, check=False, cwd=tmp_path)
    return {r["name"]: r for r in json.loads(out.read_text())}


def test_every_bad_plan_is_a_located_error(tmp_path):
    results = run_corpus(tmp_path, CASES, lambda plan: ["check", str(plan)])
    assert set(results) == set(CASES), f"cases that never finished: {set(CASES) - set(results)}"
    for i, (name, (_, says, _)) in enumerate(CASES.items()):
        r = results[name]
        err = r["err"]
        assert r["rc"] == 2, (name, r)
        assert "Traceback" not in err and "Traceback" not in r["out"], (name, err)
        assert says in err, (name, err)
        plan = tmp_path / f"case{i}" / "bad.plan"
        assert f"{plan}:" in err, (name, err)  # file:line:col
        line = err.split(f"{plan}:", 1)[1].split(":", 2)
        assert line[0].isdigit() and line[1].isdigit(), (name, err)
        if "UTF-16" not in says:
            assert "^" in err, (name, err)  # the caret under the spot
        assert r["seconds"] < 60, (name, r["seconds"])


@pytest.mark.parametrize("wrap", [False, True])
def test_fmt_keeps_the_data_inputs_and_wrap(tmp_path, wrap):
    from pipeplan.dsl import format_plan, parse_plan

    text = plan_text(source="tokens_gpt.py:TokensGPT",
                     model_extra="\n  inputs = { tokens = int64[batch, seq], pos = int64[batch, seq] }",
                     data_extra=", inputs = { pos = positions }").replace(
        "synthetic(vocab = 32, seq_len = 8", 'tokens("t.bin", seq_len = 8'
        + (", wrap = true" if wrap else ""))
    plan = parse_plan(text, "p.plan")
    assert plan.data.inputs == (("pos", "positions"),) and plan.data.wrap is wrap
    assert parse_plan(format_plan(plan), "p.plan") == plan
