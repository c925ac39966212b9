"""podray: DeepMind's Podracer architectures (Anakin, Sebulba) on JAX, orchestrated by Ray."""

from setuptools import find_packages, setup

setup(
    name="podray",
    version="0.1.0",
    description="Podracer architectures (Anakin, Sebulba) for scalable RL on JAX and Ray",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["podray", "podray.*"]) + ["podray.presets", "podray.tune_presets"],
    package_dir={"podray.presets": "configs", "podray.tune_presets": "tune_configs"},
    package_data={"podray.presets": ["*.yaml"], "podray.tune_presets": ["*.yaml"]},
    install_requires=[
        "jax>=0.6",
        "flax>=0.10",
        "optax>=0.2.4",
        "rlax>=0.1.6",
        "chex>=0.1.88",
        "gymnax>=0.0.8",
        "envpool>=0.8",
        "mctx>=0.0.5",
        "flashbax>=0.1.2",
        "orbax-checkpoint>=0.11",
        "etils[epath]",
        "fsspec",
        "ray[default,tune]>=2.40",
        "numpy",
        "pyyaml",
        "tensorboardX",
        "matplotlib",
        "imageio>=2.30",  # podray eval --video: mp4 (through imageio-ffmpeg) and gif (through Pillow)
        "imageio-ffmpeg>=0.5",  # ships an ffmpeg binary: mp4 without a system ffmpeg
        "pygame>=2.5",  # gymnasium's classic-control renderer, which gymnax's renderer calls
    ],
    extras_require={
        "tpu": ["jax[tpu]"],
        "cuda": ["jax[cuda12]"],
        # Run directories on object stores (podray.storage): fsspec filesystems for etils.epath.
        "gcs": ["gcsfs"],
        "s3": ["s3fs"],
        "test": ["pytest>=7", "ruff", "s3fs", "moto[server]>=5", "hypothesis>=6"],
    },
    entry_points={"console_scripts": ["podray=podray.cli:entry"]},
)
