"""Engine adapters behind one port (`base.Engine`); heavy engines are imported lazily."""
