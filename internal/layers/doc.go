// Package layers holds no code: its test keeps the import layering of
// ../shared/ARCHITECTURE.md, so that a wrong-way import fails CI instead of
// waiting for a review to notice it.
package layers
