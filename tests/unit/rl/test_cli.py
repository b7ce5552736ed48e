"""rl-train's start: a recipe or data set it refuses is one line and exit status 2, before
torch, Ray or an engine is loaded."""
import json
import subprocess
import sys
from pathlib import Path

import rl

ROOT = Path(rl.__file__).resolve().parents[1]
MAIN = ("import sys, rl.cli\n"
        "code = rl.cli.main(sys.argv[1:])\n"
        "print(sorted(m for m in ('ray', 'torch', 'vllm', 'deepspeed') if m in sys.modules))\n"
        "sys.exit(code)\n")


def test_a_data_set_a_reward_refuses_stops_the_start_in_one_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Write f.", "tests": ["assert f() == 1"]}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("reward:\n  functions:\n    - name: code_exec\n")
    done = subprocess.run([sys.executable, "-c", MAIN, str(recipe), f"data.train_path={rows}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("rl-train:")]
    assert len(said) == 1 and done.stderr.rstrip().endswith(said[0])
    assert said[0].startswith("rl-train: reward 'code_exec': row 0: tests[0] is the string "
                              "'assert f() == 1'; assert strings are not run any more")
    assert done.stdout.strip() == "[]"  # nothing heavy was imported


def test_rl_eval_of_a_lora_adapter_names_the_merged_model(tmp_path, capsys):
    from rl.cli import eval_main

    adapter = tmp_path / "final_model"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert eval_main([str(ROOT / "recipes" / "quickstart_lora.yaml"), str(adapter)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rl-eval: model '{adapter}' is a LoRA adapter; give the merged model saved "
                   f"beside it (final_model_merged)")
