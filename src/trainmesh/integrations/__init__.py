"""Running trainmesh under other frameworks' launchers. Each module here imports its framework, which trainmesh
does not depend on: install it yourself (`pip install "ray[train]"` for `trainmesh.integrations.ray`)."""
