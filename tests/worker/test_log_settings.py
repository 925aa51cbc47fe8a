"""worker.log_settings: Triton's LogSettings messages (built and read by tritonclient's own
protobuf) to plain values and back; the RPC against a live worker is in
tests/e2e/test_protocol_features_e2e.py."""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.logging import LogSettings
from kserve_trio.proto import inference as pb
from kserve_trio.serving.log_settings import requested_changes, settings_reply


def parsed(request: service_pb2.LogSettingsRequest) -> pb.LogSettingsRequest:
    return pb.LogSettingsRequest.parse(request.SerializeToString())


def test_each_parameter_kind_becomes_its_plain_value():
    theirs = service_pb2.LogSettingsRequest()
    theirs.settings["log_info"].bool_param = False
    theirs.settings["log_error"].bool_param = True
    theirs.settings["log_verbose_level"].uint32_param = 2
    theirs.settings["log_format"].string_param = "ISO8601"
    theirs.settings["log_file"].string_param = ""
    assert requested_changes(parsed(theirs)) == {
        "log_info": False,
        "log_error": True,
        "log_verbose_level": 2,
        "log_format": "ISO8601",
        "log_file": "",
    }


def test_no_settings_is_a_read_and_a_setting_without_a_value_is_invalid():
    assert requested_changes(parsed(service_pb2.LogSettingsRequest())) == {}
    theirs = service_pb2.LogSettingsRequest()
    theirs.settings["log_info"]  # what tritonclient sends for a None value
    with pytest.raises(InvalidArgument, match=r"^log setting 'log_info' has no value$"):
        requested_changes(parsed(theirs))


def test_the_reply_lists_every_setting_with_tritons_kinds():
    settings = LogSettings(log_info=False, log_verbose_level=3, log_format="console")
    theirs = service_pb2.LogSettingsResponse.FromString(bytes(settings_reply(settings)))
    kinds = {k: v.WhichOneof("parameter_choice") for k, v in theirs.settings.items()}
    assert kinds == {
        "log_file": "string_param",
        "log_info": "bool_param",
        "log_warning": "bool_param",
        "log_error": "bool_param",
        "log_verbose_level": "uint32_param",
        "log_format": "string_param",
    }
    s = theirs.settings
    assert (s["log_info"].bool_param, s["log_warning"].bool_param) == (False, True)
    assert s["log_verbose_level"].uint32_param == 3
    assert (s["log_format"].string_param, s["log_file"].string_param) == ("console", "")
