"""Integrations with model libraries (front doors that live in other projects' extension points)."""
