"""The persistent prefix store (the SSD tier), in parts; PersistentStore is the facade."""
