"""coordinator/serving/access.py without a socket: the API key and CORS headers."""
from __future__ import annotations

import pytest

from coordinator.serving import access
from coordinator.serving.openai_api import ApiError

KEY = "test-key-0123456789"


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY} "])
def test_the_key_as_a_bearer_token_is_let_in(header):
    access.ApiKey(KEY).check(header)


@pytest.mark.parametrize("header", ["", "Bearer", "Bearer ", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
                                    KEY, f"Token {KEY}"])
def test_anything_else_is_refused_with_401(header):
    with pytest.raises(ApiError) as info:
        access.ApiKey(KEY).check(header)
    e = info.value
    assert e.status == 401
    assert e.body() == {"error": {"message": "invalid or missing API key: send the header 'Authorization: Bearer "
                                             "<key>'", "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}}
    assert e.response_headers() == {"WWW-Authenticate": "Bearer"}


def test_a_key_outside_ascii():
    access.ApiKey("clé-ünïcode").check("Bearer clé-ünïcode")
    with pytest.raises(ApiError):
        access.ApiKey("clé-ünïcode").check("Bearer cle-unicode")


@pytest.mark.parametrize("path, needs", [
    ("/health", False), ("/metrics", False), ("/", False), ("/web/app.js", False), ("/web/style.css", False),
    ("/v1/models", True), ("/v1/completions", True), ("/v1/chat/completions", True), ("/cluster", True),
    ("/cluster/events", True), ("/props", True), ("/tokenize", True), ("/health/", True), ("/nothing", True)])
def test_which_paths_need_the_key(path, needs):
    assert access.needs_key(path) is needs


def test_preflight_headers():
    assert access.preflight_headers(None) == {
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Request-Id",
        "Access-Control-Max-Age": "86400"}
    assert access.preflight_headers("X-Custom")["Access-Control-Allow-Headers"] == "X-Custom"
    assert access.preflight_headers("")["Access-Control-Allow-Headers"] == "Authorization, Content-Type, X-Request-Id"


def test_cors_headers_vary_only_for_one_origin():
    assert access.cors_headers("*") == {"Access-Control-Allow-Origin": "*",
                                        "Access-Control-Expose-Headers": "X-Request-Id, Retry-After"}
    assert access.cors_headers("https://app.example") == {
        "Access-Control-Allow-Origin": "https://app.example",
        "Access-Control-Expose-Headers": "X-Request-Id, Retry-After", "Vary": "Origin"}
