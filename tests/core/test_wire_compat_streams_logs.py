"""Triton's ModelStreamInferResponse and log-settings messages: our generated code and
tritonclient's protobuf classes read each other's bytes field for field."""

from __future__ import annotations

from tritonclient.grpc import service_pb2 as triton

from kserve_trio.proto import inference as pb


def test_stream_response_round_trips_with_tritonclient():
    ours = pb.ModelStreamInferResponse(
        error_message="input 'x' is not declared by model 'm'",
        infer_response=pb.ModelInferResponse(model_name="m", model_version="1", id="req-7"),
    )
    theirs = triton.ModelStreamInferResponse.FromString(bytes(ours))
    assert theirs.error_message == ours.error_message
    assert (theirs.infer_response.model_name, theirs.infer_response.id) == ("m", "req-7")
    back = pb.ModelStreamInferResponse.parse(theirs.SerializeToString())
    assert back == ours


def test_log_settings_round_trip_every_parameter_kind():
    theirs = triton.LogSettingsRequest()
    theirs.settings["log_info"].bool_param = False
    theirs.settings["log_verbose_level"].uint32_param = 3
    theirs.settings["log_format"].string_param = "ISO8601"
    ours = pb.LogSettingsRequest.parse(theirs.SerializeToString())
    assert ours.settings["log_info"].bool_param is False
    assert ours.settings["log_verbose_level"].uint32_param == 3
    assert ours.settings["log_format"].string_param == "ISO8601"

    reply = pb.LogSettingsResponse(
        settings={
            "log_warning": pb.LogSettingsResponseSettingValue(bool_param=True),
            "log_verbose_level": pb.LogSettingsResponseSettingValue(uint32_param=0),
            "log_file": pb.LogSettingsResponseSettingValue(string_param=""),
        }
    )
    parsed = triton.LogSettingsResponse.FromString(bytes(reply))
    assert parsed.settings["log_warning"].WhichOneof("parameter_choice") == "bool_param"
    assert parsed.settings["log_warning"].bool_param is True
    assert parsed.settings["log_verbose_level"].WhichOneof("parameter_choice") == "uint32_param"
    assert parsed.settings["log_file"].WhichOneof("parameter_choice") == "string_param"
