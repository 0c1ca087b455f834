"""The package layout; the metadata (PEP 621) is in pyproject.toml."""
import setuptools

# `tasks/` (seqio registrations) and `gin/` (the gin files, folders only) live at the repo root
# and install as decal_jax.tasks and decal_jax/gin (found through the package: gin_utils.GIN_DIR).
# gin/experiments/ belongs to the lab (tools/ablate, tools/retention_table): not in the wheel.
GIN_FOLDERS = ["decal_jax.gin"] + ["decal_jax.gin." + name
                                   for name in setuptools.find_namespace_packages(where="gin")
                                   if not name.startswith("experiments")]

setuptools.setup(
    packages=sorted(set(setuptools.find_packages(include=["decal_jax", "decal_jax.*"]))
                    | {"decal_jax.tasks"} | set(GIN_FOLDERS)),
    package_dir={"decal_jax.tasks": "tasks", "decal_jax.gin": "gin"},
    package_data={folder: ["*.gin"] for folder in GIN_FOLDERS},
)
