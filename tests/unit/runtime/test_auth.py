"""API keys and tenants: parsing a keys file (hostile lines included), reloading it, and who a request is
billed to in each mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tally_runtime.auth import (
    ApiKeys,
    Key,
    KeysFileError,
    Tenant,
    authenticate,
    bearer,
    parse_keys,
    resolve,
)
from tally_runtime.protocol import ApiError

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-beta-0123456789abcdefg"


def test_a_keys_file_is_parsed_and_its_problems_named_by_line_only() -> None:
    keys, problems = parse_keys(f"# tenants\nteam-a {KEY_A}\n\nteam-b {KEY_B} gateway\nbroken\n"
                                f"other sk-other-0123456789abc\nteam-c short\nteam-d {KEY_A}\nteam-e {KEY_B}x admin\n")
    assert sorted(keys.values(), key=lambda k: k.tenant) == [Key("team-a"), Key("team-b", gateway=True)]
    assert [p.split(":")[0] for p in problems] == ["line 5", "line 6", "line 7", "line 8", "line 9"]
    assert not [p for p in problems if KEY_A in p or "sk-other" in p]  # no key reaches a log


@pytest.mark.parametrize(("values", "key"), [
    pytest.param([f"Bearer {KEY_A}"], KEY_A, id="bearer"),
    pytest.param([f"bearer   {KEY_A} "], KEY_A, id="case-and-spaces"),
    pytest.param([f"Basic {KEY_A}"], None, id="another-scheme"),
    pytest.param([f"Bearer {KEY_A}", f"Bearer {KEY_B}"], None, id="two-headers"),
    pytest.param([], None, id="none"),
])
def test_bearer(values: list[str], key: str | None) -> None:
    assert bearer(values) == key


def keys_file(tmp_path: Path, text: str) -> ApiKeys:
    path = tmp_path / "api-keys"
    path.write_text(text)
    return ApiKeys(path)


def test_keys_are_required_and_name_the_tenant(tmp_path: Path) -> None:
    keys = keys_file(tmp_path, f"team-a {KEY_A}\n")
    assert authenticate(keys, [f"Bearer {KEY_A}"]) == Key("team-a")
    for header in ([], [f"Bearer {KEY_B}"]):
        with pytest.raises(ApiError) as refused:
            authenticate(keys, header)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
    assert authenticate(None, []) is None


GATEWAY = Key("gateway", gateway=True)


@pytest.mark.parametrize(("keyed", "headers", "trust", "user", "tenant"), [
    pytest.param(Key("team-a"), ["spoofed"], False, "someone", Tenant("team-a", "key"), id="key-beats-header-and-user"),
    pytest.param(GATEWAY, ["team-x"], True, None, Tenant("team-x", "header"), id="gateway-mode"),
    pytest.param(GATEWAY, [], True, None, Tenant("gateway", "key"), id="gateway-without-header"),
    pytest.param(Key("team-a"), [], True, None, Tenant("team-a", "key"), id="plain-key-in-gateway-mode"),
    pytest.param(None, ["team-y"], True, "u", Tenant("team-y", "header"), id="no-keys-header"),
    pytest.param(None, [], True, "user-7", Tenant("user-7", "user"), id="no-keys-user"),
    pytest.param(None, [], True, None, Tenant("anonymous", "none"), id="nobody"),
])
def test_who_is_billed(keyed: Key | None, headers: list[str], trust: bool, user: str | None, tenant: Tenant) -> None:
    assert resolve(keyed, headers, trust, "X-Tally-Tenant", user) == tenant


def test_in_gateway_mode_only_a_gateway_key_may_name_the_tenant() -> None:
    with pytest.raises(ApiError) as refused:
        resolve(Key("team-a"), ["team-b"], True, "X-Tally-Tenant", None)
    assert (refused.value.status, refused.value.code) == (403, "tenant_header_not_allowed")


@pytest.mark.parametrize(("headers", "user"), [
    pytest.param(["a", "b"], None, id="header-twice"),
    pytest.param(["other"], None, id="header-names-the-overflow-bucket"),
    pytest.param([], "other", id="user-names-the-overflow-bucket"),
])
def test_ambiguous_or_reserved_tenants_are_refused(headers: list[str], user: str | None) -> None:
    with pytest.raises(ApiError) as refused:
        resolve(None, headers, True, "X-Tally-Tenant", user)
    assert (refused.value.status, refused.value.code) == (400, "invalid_tenant")


def test_a_rotated_secret_is_reloaded_and_a_broken_one_revokes_every_key(tmp_path: Path) -> None:
    """Revocation fails closed: a Secret emptied, left with nothing usable, or removed leaves no key valid
    (the review found the old keys kept working until a restart)."""
    keys = keys_file(tmp_path, f"team-a {KEY_A}\n")
    path = tmp_path / "api-keys"
    replacement = tmp_path / "api-keys.new"  # the kubelet swaps a mounted Secret's file atomically
    replacement.write_text(f"team-b {KEY_B}\n")
    os.replace(replacement, path)
    keys.checked = -1e9  # the next look is due (it looks at most once a second)
    assert keys.key_of(KEY_B) == Key("team-b") and keys.key_of(KEY_A) is None and not keys.problem
    for broken in ("nonsense\n", "", None):
        if broken is None:
            path.unlink()
        else:
            path.write_text(broken)
        keys.checked = -1e9
        assert keys.key_of(KEY_B) is None and keys.problem, broken
        path.write_text(f"team-b {KEY_B}\n")
        keys.checked = -1e9
        assert keys.key_of(KEY_B) == Key("team-b") and not keys.problem


def test_a_keys_file_that_cannot_be_used_at_start_up_stops_the_runtime(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="no usable key"):
        keys_file(tmp_path, "# nothing\n")
    with pytest.raises(KeysFileError, match="cannot read"):
        ApiKeys(tmp_path / "missing")
