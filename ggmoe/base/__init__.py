"""The leaves every other package stands on: domain errors, the name -> class registry, byte sizes, TOML and
.npz files, output paths, declared options, the prompt rule and the version. They import nothing of ggmoe
but each other (``errors`` at the bottom)."""
