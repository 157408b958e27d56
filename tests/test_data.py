"""`war.data`: the bundled files are found by name, and only they."""

from __future__ import annotations

from pathlib import Path

import pytest

from war import data


def test_bundled_files_are_found() -> None:
    assert data.resource(data.SAMPLE_TRACES).is_file()
    assert data.resource(f"{data.POLICY}/config.json").is_file()
    assert data.gpt2_tokenizer_json().startswith("{")
    assert (data.policy_path() / "config.json").is_file()


@pytest.mark.parametrize("name", [
    "../api.py", "policy/../../api.py", "..\\api.py", str(Path(__file__).resolve()),
    "", ".", data.POLICY, "missing.json",
])
def test_names_outside_the_bundle_are_not_found(name: str) -> None:
    # joinpath follows '..' and absolute names out of the package
    with pytest.raises(FileNotFoundError, match=r"war\.data has no bundled file"):
        data.resource(name)
