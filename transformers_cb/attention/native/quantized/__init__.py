"""The native library's C++ sources over quantized data, spliced by native_source.py: the products over GGUF
blocks (native_quant_source.py), torchao's int8 weight-only product (native_int8_source.py) and the int8 KV
cache's write (native_kv_quant_source.py)."""
