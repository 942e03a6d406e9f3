"""schemathesis against the OpenAPI document the server publishes: its coverage phase (every
boundary and every kind of invalid value the schema implies) and its fuzzing phase on every
route, in-process. No answer may be a 5xx, every status code, content type, header and JSON body
must be one the document describes, and every body the document forbids must be refused."""

from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.llm import build_engine_config
from specserve.server.app import build_app
from tests.conftest import DEVICE

# a long run: SPECSERVE_SCHEMATHESIS_EXAMPLES=400 pytest -s tests/server/test_schemathesis.py
EXAMPLES = int(os.environ.get("SPECSERVE_SCHEMATHESIS_EXAMPLES", "60"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def api_schema(text_model_dir):
    # a short context bounds max_tokens (a longer one is a documented 400), so every
    # generated request runs in milliseconds on the tiny model
    engine = LLMEngine(build_engine_config(str(text_model_dir), None, device=DEVICE,
                                           max_model_len=48))
    app = build_app(engine, ServerConfig(allowed_hosts="testserver"))   # the ASGI client's Host
    config = SchemathesisConfig.from_dict({"phases": {
        "examples": {"enabled": False}, "coverage": {"enabled": True},
        "fuzzing": {"enabled": True}, "stateful": {"enabled": False}}})
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")
_sent: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\nschemathesis: {sum(_sent.values())} requests, by status {dict(_sent)}")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_the_server_answers_as_its_openapi_document_says(case):
    _sent[case.call_and_validate(checks=CHECKS).status_code] += 1
