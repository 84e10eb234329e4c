"""hearth.resources: icons, stylesheets and the bundled demo model, read via importlib.resources."""
