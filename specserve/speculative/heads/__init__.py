"""Draft networks (nn.Modules) shared by serving and training."""
