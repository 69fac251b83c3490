"""deploy/compat.py: the application refuses a Ray the test suite did not run against."""

from __future__ import annotations

import logging

import pytest
import ray

from deploy.compat import ALLOW_ENV, TESTED_RAY, check_ray_version


def test_the_installed_ray_is_a_tested_one():
    check_ray_version()  # the suite runs on what pyproject.toml pins
    assert tuple(int(x) for x in ray.__version__.split(".")[:2]) in TESTED_RAY


@pytest.mark.parametrize("version", ["2.61.0", "2.59.1", "3.0.0", "2.7.0"])
def test_an_untested_ray_fails_saying_what_to_install(version, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    expected = rf"tested with Ray 2\.60 and this is Ray {version}.*ray\[serve\]==2\.60\.\*"
    with pytest.raises(RuntimeError, match=expected):
        check_ray_version(version)


def test_a_patch_release_of_a_tested_ray_is_accepted():
    check_ray_version("2.60.3")


def test_the_override_tries_an_untested_ray_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="deploy.compat"):
        check_ray_version("2.61.0")
    assert "this is Ray 2.61.0" in caplog.text and f"{ALLOW_ENV}=1: trying" in caplog.text
