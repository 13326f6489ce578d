"""The detect_hardware stage: devices (NVML, /proc, CPU), the GPU catalog, measured precision speed,
and hardware.json's types (`report`)."""
