"""The HTTP/2 tuning patches still apply to the installed h2/hyperframe/grpclib."""

from __future__ import annotations

import hyperframe.frame as hf

from kserve_trio.serving import h2_settings


def test_data_frame_repr_no_longer_hexlifies_the_whole_payload():
    assert h2_settings.patch_frame_repr()
    frame = hf.DataFrame(1, data=b"\x01" * (4 << 20))
    text = repr(frame)
    assert "<hex:01010101010101010101...>" in text
    assert len(text) < 200


def test_server_config_sets_large_windows_and_frame_size_patch(monkeypatch):
    monkeypatch.delenv("KSERVE_TRIO_H2_TUNING", raising=False)
    cfg = h2_settings.server_config()
    assert cfg.http2_connection_window_size == h2_settings.WINDOW_BYTES
    assert cfg.http2_stream_window_size == h2_settings.WINDOW_BYTES
    import grpclib.protocol as gp

    assert gp.H2Protocol.connection_made.__name__ == "connection_made"
    assert "frame_size" in h2_settings._patched


def test_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KSERVE_TRIO_H2_TUNING", "0")
    cfg = h2_settings.server_config()
    assert cfg.http2_connection_window_size != h2_settings.WINDOW_BYTES


def test_large_frames_are_negotiated_with_a_real_client(demo_repo):
    import numpy as np
    import tritonclient.grpc as grpcclient

    from kserve_trio.worker.server import serve, stop

    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        endpoints={"port": 0},
    )
    try:
        c = grpcclient.InferenceServerClient(running.address)
        x = np.random.default_rng(0).standard_normal((32, 3, 32, 32), dtype=np.float32)
        inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert c.infer("cnn", [inp]).as_numpy("output").shape == (32, 10)
        # A fresh connection whose first request exceeds 16 KiB: C-core may send a large DATA
        # frame before it acknowledges our SETTINGS; the server must accept it.
        for rows in range(2, 22):
            fresh = grpcclient.InferenceServerClient(running.address)
            x = np.ones((rows, 3, 32, 32), np.float32)
            inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            assert fresh.infer("cnn", [inp]).as_numpy("output").shape == (rows, 10)
            fresh.close()
    finally:
        stop(running)
