"""Model implementations (our own PyTorch code), the registry and the safetensors loader."""
