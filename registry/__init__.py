"""What models exist: Ollama-style names, the models.yaml schema, the local store and pairings.

May import only the standard library, pyyaml and huggingface_hub; never mlx, never the other
mlxd packages.
"""
