import math

import pytest

from klevict_cli.errors import UsageError
from klevict_cli.options import (
    OPTION_TYPES,
    Budget,
    check_choice,
    check_int_range,
    check_positive_int,
    check_real,
    load_config,
    merge_options,
    parse_budget,
    format_size,
    parse_size,
)

# --- budgets ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "budget", "canonical"),
    [
        ("5%", Budget(fraction=0.05), "5%"),
        ("12.5%", Budget(fraction=0.125), "12.5%"),
        ("100%", Budget(fraction=1.0), "100%"),
        ("0.5%", Budget(fraction=0.005), "0.5%"),
        ("0.05", Budget(fraction=0.05), "5%"),
        ("1.0", Budget(fraction=1.0), "100%"),
        (".25", Budget(fraction=0.25), "25%"),
        ("2048", Budget(tokens=2048), "2048"),
        ("1", Budget(tokens=1), "1"),
        ("2k", Budget(tokens=2048), "2048"),
        ("2K", Budget(tokens=2048), "2048"),
        ("1.5k", Budget(tokens=1536), "1536"),
        ("1m", Budget(tokens=1024 * 1024), "1048576"),
        ("1M", Budget(tokens=1024 * 1024), "1048576"),
        ("0.1k", Budget(tokens=102), "102"),  # rounded to a whole token
        ("5 %", Budget(fraction=0.05), "5%"),  # spaces are ignored
        (" 2 k ", Budget(tokens=2048), "2048"),
    ],
)
def test_budget_accepted(text, budget, canonical):
    parsed = parse_budget(text)
    assert parsed.tokens == budget.tokens
    assert parsed.fraction == (None if budget.fraction is None else pytest.approx(budget.fraction))
    assert str(parsed) == canonical
    assert parse_budget(str(parsed)).resolve(10_000) == parsed.resolve(10_000)


@pytest.mark.parametrize(
    "text",
    ["", " ", "abc", "0", "0%", "0.0", "-5%", "-5", "150%", "100.1%", "1.5", "2.0", "nan", "inf", "-inf", "1e3",
     "1_000", "5%%", "k", "%", "0k", "0.0001k", "5 percent", "2kb", "1.5.2", "0x10", "3000000000", "9999999k",
     "9" * 400, "9" * 400 + "k", "9" * 400 + "%"],
)
def test_budget_rejected(text):
    with pytest.raises(UsageError) as info:
        parse_budget(text)
    message = str(info.value)
    assert f"'{text}'" in message
    for form in ("5%", "0.05", "2048", "2k"):
        assert form in message  # the accepted forms are listed


@pytest.mark.parametrize(
    ("budget", "n_tokens", "kept"),
    [
        (Budget(fraction=0.05), 100, 5),  # not 6 from 5.000000000000001
        (Budget(fraction=0.05), 101, 6),  # rounds up
        (Budget(fraction=0.05), 10, 1),
        (Budget(fraction=0.01), 1, 1),  # never 0
        (Budget(fraction=0.01), 0, 1),
        (Budget(fraction=1.0), 777, 777),
        (Budget(fraction=0.125), 1000, 125),
        (Budget(tokens=2048), 100, 2048),
        (Budget(tokens=2048), 10**6, 2048),
        (Budget(fraction=0.1, at_least=96), 344, 96),  # a short note: the floor
        (Budget(fraction=0.1, at_least=96), 50, 50),  # never more than the document
        (Budget(fraction=0.1, at_least=96), 4096, 410),  # a long one: the share
    ],
)
def test_budget_resolve(budget, n_tokens, kept):
    assert budget.resolve(n_tokens) == kept


def test_percent_resolves_exactly_for_many_sizes():
    for percent in (1, 3, 5, 7, 10, 12.5, 33, 50):
        budget = parse_budget(f"{percent}%")
        for n in (100, 200, 1000, 4000):
            assert budget.resolve(n) == math.ceil(percent * n / 100 - 1e-9)


@pytest.mark.parametrize(
    "kwargs", [{}, {"fraction": 0.5, "tokens": 3}, {"fraction": 0.0}, {"fraction": 1.5}, {"tokens": 0},
               {"tokens": 64, "at_least": 96}, {"fraction": 0.1, "at_least": -5}, {"fraction": 0.1, "at_least": 9.5}]
)
def test_budget_invariants(kwargs):
    with pytest.raises(ValueError):
        Budget(**kwargs)


def test_the_default_budget_is_ten_percent_with_a_floor_and_a_given_budget_is_taken_as_given():
    from klevict_cli.reading import DEFAULT_BUDGET, read_budget

    assert read_budget({"budget": None}) == DEFAULT_BUDGET and str(DEFAULT_BUDGET) == "10% (at least 96)"
    assert read_budget({"budget": "10%"}) == Budget(fraction=0.1)
    assert read_budget({"budget": None, "max_kl": 0.02}) is None


def test_one_budget_spelled_two_ways_is_one_budget():
    """"5%" and "0.05" keep the same entries, so a bench list that names both names one budget twice."""
    from klevict_cli.bench import parse_budgets

    assert parse_budget("5%") == parse_budget("0.05") == Budget(fraction=0.05)
    with pytest.raises(UsageError, match="listed twice"):
        parse_budgets("5%, 0.05")


# --- config file -----------------------------------------------------------------------------------------------


def config_file(tmp_path, text):
    path = tmp_path / "klevict.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(tmp_path, text):
    with pytest.raises(UsageError) as info:
        load_config(config_file(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message and "klevict.yaml" in message
    return message


def test_no_config_path_means_no_config():
    assert load_config(None) == {}


def test_config_values_and_key_spellings(tmp_path):
    path = config_file(
        tmp_path,
        """
        model: Qwen/Qwen2.5-0.5B
        budget: 5%
        chunk-size: 512
        max_new_tokens: 64
        temperature: 1
        top-p: 0.9
        position-mode: compact
        json: true
        quiet: no
        """.replace("\n        ", "\n"),
    )
    assert load_config(path) == {
        "model": "Qwen/Qwen2.5-0.5B",
        "budget": "5%",
        "chunk_size": 512,
        "max_new_tokens": 64,
        "temperature": 1.0,
        "top_p": 0.9,
        "position_mode": "compact",
        "json": True,
        "quiet": False,
    }
    assert isinstance(load_config(path)["temperature"], float)


def test_every_option_type_is_known():
    assert set(OPTION_TYPES.values()) <= {str, int, float, bool}
    assert OPTION_TYPES["chunk_size"] is int and OPTION_TYPES["json"] is bool and OPTION_TYPES["top_p"] is float


@pytest.mark.parametrize(("text", "expected"), [("budget: 2048", "2048"), ("budget: 0.05", "0.05")])
def test_numbers_are_taken_for_string_options(tmp_path, text, expected):
    assert load_config(config_file(tmp_path, text)) == {"budget": expected}
    assert parse_budget(expected)


@pytest.mark.parametrize(("text", "expected"), [("max-kl: 1e-2", 0.01), ("temperature: 2E+0", 2.0),
                                               ("top-p: .5e0", 0.5), ("max-kl: -1.5e-3", -0.0015)])
def test_a_float_in_exponent_form_is_a_number(tmp_path, text, expected):
    """YAML 1.1 reads 1e-2 as a string (its floats need a point): `max-kl: 1e-2` was refused as not a number though
    `--max-kl 1e-2` is one."""
    key, _, _ = text.partition(":")
    assert load_config(config_file(tmp_path, text)) == {key.replace("-", "_"): expected}
    assert "must be a string" in config_error(tmp_path, "model: [1e-2]")
    assert load_config(config_file(tmp_path, "prompt: 1e-2")) == {"prompt": "1e-2"}  # a string option keeps it


def test_a_merge_key_merges_and_the_mapping_overrides(tmp_path):
    """`<<:` (YAML's merge key) failed as malformed YAML: "could not determine a constructor for the tag"."""
    text = "<<: {seed: 1, max-new-tokens: 3}\nseed: 2\n"
    assert load_config(config_file(tmp_path, text)) == {"seed": 2, "max_new_tokens": 3}
    assert "unknown key 'x'" in config_error(tmp_path, "<<: {x: 1}\n")


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_config(tmp_path, text):
    assert load_config(config_file(tmp_path, text)) == {}


def test_unknown_key_lists_valid_keys(tmp_path):
    message = config_error(tmp_path, "chunksize: 5\n")
    assert "unknown key 'chunksize'" in message and "chunk-size" in message and "max-new-tokens" in message


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("chunk-size: 1.5", "chunk-size", "an integer"),
        ("chunk_size: '512'", "chunk_size", "an integer"),
        ("seed: true", "seed", "an integer"),  # a bool is not an int
        ("temperature: hot", "temperature", "a number"),
        ("temperature: yes", "temperature", "a number"),
        ("temperature: .nan", "temperature", "a number"),
        ("json: 1", "json", "true or false"),
        ("quiet: 'yes'", "quiet", "true or false"),
        ("model: [a, b]", "model", "a string"),
        ("prompt: {a: 1}", "prompt", "a string"),
        ("device: off", "device", "a string"),  # YAML reads off as false
        ("seed:", "seed", "an integer"),
    ],
)
def test_wrong_type_names_key_and_type(tmp_path, text, key, expected):
    message = config_error(tmp_path, text)
    assert f"key '{key}'" in message and f"must be {expected}" in message


@pytest.mark.parametrize(("text", "shown"), [
    ("device: off", "got false (YAML reads yes, no, on and off as true or false: quote the value)"),
    ("prompt: 2020-01-01", "got a date (2020-01-01: quote the value)"),
    ("model: 2020-01-01 10:00:00", "got a date (2020-01-01 10:00:00: quote the value)"),
    ("budget: !!binary aGVsbG8=", "got a binary value (!!binary)"),
])
def test_a_wrong_value_is_shown_as_yaml_wrote_it(tmp_path, text, shown):
    """Not as Python prints it: `got False`, `got datetime.date(2020, 1, 1)`, `got b'hello'`."""
    assert config_error(tmp_path, text).endswith(shown)


def test_position_mode_choice_is_checked(tmp_path):
    message = config_error(tmp_path, "position_mode: sideways")
    assert "key 'position_mode' must be one of: auto, original, compact; got 'sideways'" in message


def test_same_key_with_dashes_and_underscores(tmp_path):
    assert "twice" in config_error(tmp_path, "chunk-size: 1\nchunk_size: 2\n")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    assert "mapping" in config_error(tmp_path, text)


def test_malformed_yaml_names_the_line(tmp_path):
    message = config_error(tmp_path, "model: a\nbudget: [5%\nseed: 1\n")
    assert "malformed YAML" in message and "line" in message


def test_malformed_yaml_line_number(tmp_path):
    message = config_error(tmp_path, "model: a\nseed: 1\n  bad: indent\n")
    assert "line 3" in message


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_config_from_a_dash_says_it_needs_a_file():
    with pytest.raises(UsageError, match="config file -: give a file; - reads standard input for documents"):
        load_config("-")


def test_config_directory(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        load_config(tmp_path)


def test_config_not_utf8(tmp_path):
    path = tmp_path / "klevict.yaml"
    path.write_bytes(b"model: \xff\xfe\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_config(path)


# --- merging and checks ----------------------------------------------------------------------------------------


def test_merge_precedence():
    defaults = {"budget": "10%", "seed": 0, "quiet": False, "chunk_size": 512}
    config = {"budget": "5%", "seed": 7}
    cli = {"budget": None, "seed": 3, "quiet": None, "output": None}
    assert merge_options(cli, config, defaults) == {
        "budget": "5%",  # config beats default when the CLI is silent
        "seed": 3,  # CLI beats config
        "quiet": False,  # default when neither is given
        "chunk_size": 512,
        "output": None,  # known only to the CLI, still present
    }


def test_merge_keeps_falsy_cli_values():
    assert merge_options({"quiet": False, "seed": 0}, {"quiet": True, "seed": 9}, {}) == {"quiet": False, "seed": 0}


def test_merge_does_not_modify_inputs():
    cli, config, defaults = {"a": 1}, {"b": 2}, {"a": 0, "b": 0, "c": 0}
    merge_options(cli, config, defaults)
    assert (cli, config, defaults) == ({"a": 1}, {"b": 2}, {"a": 0, "b": 0, "c": 0})


def test_check_choice():
    assert check_choice("method", "kl", ("kl", "h2o", "snapkv")) == "kl"
    with pytest.raises(UsageError) as info:
        check_choice("method", "x", ("a", "b", "c"))
    assert str(info.value) == "invalid --method 'x'; choose from: a, b, c"


def test_check_choice_uses_dashes():
    with pytest.raises(UsageError, match=r"--cache-dtype 'int3'"):
        check_choice("cache_dtype", "int3", ["fp16", "int8"])


@pytest.mark.parametrize("value", [1, 512])
def test_positive_int_accepted(value):
    assert check_positive_int("chunk_size", value, maximum=512) == value


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_positive_int_rejected(value):
    with pytest.raises(UsageError, match="invalid --chunk-size .*must be a positive integer"):
        check_positive_int("chunk_size", value)


def test_positive_int_maximum():
    assert check_positive_int("seed", 10**9) == 10**9
    with pytest.raises(UsageError, match="invalid --chunk-size '513'; must be an integer from 1 to 512"):
        check_positive_int("chunk_size", 513, maximum=512)


@pytest.mark.parametrize("text", ["0", "lots", "-1G", "9" * 400, "9" * 400 + "G", "99999999T"])
def test_size_rejected(text):
    with pytest.raises(UsageError, match="--max-memory"):
        parse_size("max_memory", text)


def test_size_accepted():
    assert parse_size("max_memory", "1.5GiB") == 3 * 2**29
    assert parse_size("max_memory", "2000000") == 2_000_000


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [("top_p", float("nan"), True), ("top_p", float("inf"), True), ("temperature", float("-inf"), True)],
)
def test_real_options_refuse_nan_and_infinity_whatever_the_rule_says(name, value, accepted):
    with pytest.raises(UsageError, match=f"--{name.replace('_', '-')}"):
        check_real(name, value, accepted, "finite")


def test_int_range():
    assert check_int_range("seed", 2**64 - 1, 0, 2**64 - 1) == 2**64 - 1
    for bad in (2**64, -1, True, 1.0):
        with pytest.raises(UsageError, match="--seed"):
            check_int_range("seed", bad, 0, 2**64 - 1)


@pytest.mark.parametrize(("size", "shown"), [(512, "512 bytes"), (2**20, "1.00 MiB"), (3 * 2**29, "1.50 GiB"),
                                             (300 * 2**20, "300 MiB"), (5 * 2**40, "5.00 TiB")])
def test_format_size(size, shown):
    assert format_size(size) == shown
    assert parse_size("max_memory", shown.replace(" bytes", "")) == size


def test_byte_limits_are_sizes_or_shares_of_the_full_cache():
    from klevict_cli.options import ByteLimit, parse_byte_limit

    assert parse_byte_limit("5%") == ByteLimit(share=0.05) and str(ByteLimit(share=0.05)) == "5%"
    assert parse_byte_limit(" 40M ") == ByteLimit(size=40 * 2**20) and str(ByteLimit(size=40 * 2**20)) == "40 MiB"
    assert parse_byte_limit("12.5%").resolve(1000) == 125 and parse_byte_limit("2k").resolve(10**9) == 2048
    for bad in ("0%", "101%", "-1%", "nan%", "5 %%", "lots", "", "0"):
        with pytest.raises(UsageError, match="--max-bytes"):
            parse_byte_limit(bad)
