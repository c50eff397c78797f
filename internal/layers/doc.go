// Package layers holds the test that keeps moex's packages in the layers DESIGN.md draws:
// no package imports one above it.
package layers
