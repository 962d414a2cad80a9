"""The bundled tiny model: its chat format, data recipe, training and evaluation."""
