"""Parts of :func:`qir.utils.onnx_helper.export_to_onnx`; the public entry point is ``onnx_helper``."""
