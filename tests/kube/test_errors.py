"""The one error mapping of the API edge: each status to its class, the body parsed once, and the
three message forms qgpu quotes unchanged (pure: no apiserver; raised ApiExceptions and socket
errors stand in for the client's)."""

from __future__ import annotations

import json

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.kube.errors import (
    ApiError,
    Conflict,
    KubeError,
    NotFound,
    Transient,
    Unavailable,
    Unreachable,
    brief,
    call,
    classify,
    described,
    status_message,
)
from qgpu_runtime.kube.retry import is_transient, with_backoff


def refusal(status: int | None, reason: str = "Reason", message: str | None = "the apiserver's words") -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "code": status, "message": message}) if message is not None else "plain text"
    return exc


def raising(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc
    return fn


@pytest.mark.parametrize("status, kind", [
    (404, NotFound), (409, Conflict), (429, Unavailable), (500, Unavailable), (502, Unavailable), (503, Unavailable),
    (504, Unavailable), (0, Unavailable), (None, Unavailable), (400, ApiError), (401, ApiError), (403, ApiError),
    (410, ApiError), (422, ApiError),
])
def test_each_status_has_its_class_and_only_the_retryable_ones_are_transient(status, kind):
    with pytest.raises(kind) as caught:
        call(raising(refusal(status)))
    error = caught.value
    assert type(error) is kind and isinstance(error, ApiError) and isinstance(error, KubeError)
    assert error.status == status and error.message == "the apiserver's words"
    assert isinstance(error.__cause__, ApiException)
    assert is_transient(error) is (kind is Unavailable) is isinstance(error, Transient)
    assert is_transient(refusal(status)) is is_transient(error)  # the raw exception is judged alike


@pytest.mark.parametrize("network", [ConnectionRefusedError("refused"), TimeoutError("read timed out"),
                                     urllib3.exceptions.MaxRetryError(None, "/api", ConnectionResetError("reset"))])
def test_no_answer_is_unreachable_transient_and_no_api_error(network):
    with pytest.raises(Unreachable) as caught:
        call(raising(network))
    error = caught.value
    assert error.cause is network and isinstance(error, Transient) and not isinstance(error, ApiError)
    assert str(error) == str(network) and is_transient(error) and is_transient(network)


def test_the_call_passes_arguments_and_answers_through():
    assert call(lambda a, b=0: a + b, 1, b=2) == 3


@pytest.mark.parametrize("body, message", [
    ('{"kind":"Status","message":"pods \\"p\\" not found"}', 'pods "p" not found'),
    (b'{"message":"as bytes"}', "as bytes"),
    ('{"message":""}', None), ('{"code":500}', None), ("not json", None), ("[1, 2]", None), ("", None), (None, None),
])
def test_the_body_is_parsed_once_into_the_apiservers_message(body, message):
    assert status_message(body) == message
    exc = ApiException(status=500, reason="Internal Server Error")
    exc.body = body
    assert classify(exc).message == message


def test_the_three_message_forms_keep_their_words():
    forbidden = classify(refusal(403, "Forbidden", 'leases "x" is forbidden'))
    assert str(forbidden) == '403 Forbidden: leases "x" is forbidden'  # webhook: "the apiserver answered …"
    assert forbidden.brief() == brief(forbidden) == '403 leases "x" is forbidden'  # extender bind messages
    assert forbidden.described() == described(forbidden) == 'HTTP 403 leases "x" is forbidden'  # node manager
    bare = classify(refusal(503, "Service Unavailable", None))
    assert (str(bare), bare.brief(), bare.described()) == ("503 Service Unavailable: plain text", "503 Service Unavailable",
                                                            "HTTP 503 Service Unavailable")
    # raw exceptions are quoted the same way, and anything else by its type
    assert brief(refusal(404, "Not Found", None)) == "404 Not Found" and described(refusal(404, "Not Found")) == (
        "HTTP 404 the apiserver's words")
    assert brief(ValueError("odd")) == "ValueError: odd"
    wrapped = urllib3.exceptions.MaxRetryError(None, "/api", ConnectionRefusedError("refused"))
    assert described(wrapped) == "MaxRetryError: refused" == Unreachable(wrapped).described()
    assert Unreachable(wrapped).brief() == f"MaxRetryError: {wrapped}"


def test_backoff_retries_the_mapped_transient_errors_and_stops_at_the_others():
    delays: list[float] = []
    answers = iter([refusal(503), ConnectionResetError("reset"), "ok"])

    def flaky() -> str:
        item = next(answers)
        if isinstance(item, BaseException):
            raise item
        return item

    assert with_backoff(lambda: call(flaky), attempts=3, sleep=delays.append) == "ok" and len(delays) == 2
    with pytest.raises(Conflict):
        with_backoff(lambda: call(raising(refusal(409))), attempts=3, sleep=delays.append)
    assert len(delays) == 2
