package report

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"strconv"
	"strings"
)

// Series is one line of a chart. Points with a NaN coordinate are skipped
// (the line breaks there).
type Series struct {
	Name   string
	X, Y   []float64
	Dashed bool
	Gray   bool // drawn in gray (references such as the limit and the demand)
}

// Chart is a line chart, drawn the same way as SVG and as PNG (the PNG with
// a built-in 5x7 bitmap font, no dependency).
type Chart struct {
	Title, XLabel, YLabel string
	Series                []Series
	W, H                  int // pixels (default 1000 x 520)
}

var palette = []color.RGBA{
	{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}, {214, 39, 40, 255},
	{148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}, {23, 190, 207, 255},
}

var (
	black = color.RGBA{0, 0, 0, 255}
	gray  = color.RGBA{120, 120, 120, 255}
	light = color.RGBA{225, 225, 225, 255}
)

type canvas interface {
	polyline(pts [][2]float64, c color.RGBA, width float64, dashed bool)
	text(x, y float64, s string, anchor int, c color.RGBA) // anchor 0 left, 1 centre, 2 right; y is the baseline
	vtext(x, y float64, s string, c color.RGBA)            // rotated 90 degrees, centred on (x, y)
}

const (
	marginL, marginR, marginT, marginB = 90, 190, 44, 60
	textScale                          = 2
)

func niceStep(span float64, n int) float64 {
	if !(span > 0) {
		return 1
	}
	raw := span / float64(n)
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func label(v, step float64) string {
	d := 0
	if step < 1 {
		d = int(math.Ceil(-math.Log10(step) - 1e-9))
		if d > 6 {
			d = 6
		}
	}
	if math.Abs(v) < step/1e6 {
		v = 0
	}
	return strconv.FormatFloat(v, 'f', d, 64)
}

func (c *Chart) size() (int, int) {
	w, h := c.W, c.H
	if w == 0 {
		w = 1000
	}
	if h == 0 {
		h = 520
	}
	return w, h
}

// draw lays the chart out on cv.
func (c *Chart) draw(cv canvas) {
	w, h := c.size()
	x0, x1, y0, y1 := math.Inf(1), math.Inf(-1), 0.0, math.Inf(-1)
	for _, s := range c.Series {
		for i := range s.X {
			if math.IsNaN(s.X[i]) || math.IsNaN(s.Y[i]) || math.IsInf(s.Y[i], 0) {
				continue
			}
			x0, x1 = math.Min(x0, s.X[i]), math.Max(x1, s.X[i])
			y0, y1 = math.Min(y0, s.Y[i]), math.Max(y1, s.Y[i])
		}
	}
	if math.IsInf(x0, 0) {
		x0, x1, y1 = 0, 1, 1
	}
	if x1 == x0 {
		x1 = x0 + 1
	}
	if y1 <= y0 {
		y1 = y0 + 1
	}
	xs, ys := niceStep(x1-x0, 8), niceStep(y1-y0, 6)
	y1 = math.Ceil(y1/ys-1e-9) * ys
	y0 = math.Floor(y0/ys+1e-9) * ys
	pl, pr, pt, pb := float64(marginL), float64(w-marginR), float64(marginT), float64(h-marginB)
	px := func(x float64) float64 { return pl + (x-x0)/(x1-x0)*(pr-pl) }
	py := func(y float64) float64 { return pb - (y-y0)/(y1-y0)*(pb-pt) }
	// Grid and ticks.
	for v := math.Ceil(y0/ys-1e-9) * ys; v <= y1+ys/1e6; v += ys {
		cv.polyline([][2]float64{{pl, py(v)}, {pr, py(v)}}, light, 1, false)
		cv.text(pl-6, py(v)+7, label(v, ys), 2, black)
	}
	for v := math.Ceil(x0/xs-1e-9) * xs; v <= x1+xs/1e6; v += xs {
		cv.polyline([][2]float64{{px(v), pt}, {px(v), pb}}, light, 1, false)
		cv.text(px(v), pb+22, label(v, xs), 1, black)
	}
	cv.polyline([][2]float64{{pl, pt}, {pl, pb}, {pr, pb}}, black, 1.5, false)
	cv.text(float64(w)/2, 28, c.Title, 1, black)
	cv.text((pl+pr)/2, float64(h)-12, c.XLabel, 1, black)
	cv.vtext(20, (pt+pb)/2, c.YLabel, black)
	// Lines and legend.
	k := 0
	for i, s := range c.Series {
		col := gray
		if !s.Gray {
			col = palette[k%len(palette)]
			k++
		}
		var pts [][2]float64
		flush := func() {
			if len(pts) > 0 {
				cv.polyline(pts, col, 2, s.Dashed)
			}
			pts = pts[:0]
		}
		for j := range s.X {
			if math.IsNaN(s.X[j]) || math.IsNaN(s.Y[j]) || math.IsInf(s.Y[j], 0) {
				flush()
				continue
			}
			pts = append(pts, [2]float64{px(s.X[j]), py(s.Y[j])})
		}
		flush()
		ly := pt + 10 + float64(i)*24
		cv.polyline([][2]float64{{pr + 12, ly}, {pr + 40, ly}}, col, 3, s.Dashed)
		cv.text(pr+46, ly+7, s.Name, 0, black)
	}
}

// SVG renders the chart as an SVG document.
func (c *Chart) SVG() []byte {
	w, h := c.size()
	var b bytes.Buffer
	fmt.Fprintf(&b, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n", w, h, w, h)
	fmt.Fprintf(&b, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", w, h)
	c.draw(&svgCanvas{b: &b})
	b.WriteString("</svg>\n")
	return b.Bytes()
}

type svgCanvas struct{ b *bytes.Buffer }

func hex(c color.RGBA) string { return fmt.Sprintf("#%02x%02x%02x", c.R, c.G, c.B) }

func ff(x float64) string { return strconv.FormatFloat(x, 'f', 1, 64) }

func (s *svgCanvas) polyline(pts [][2]float64, c color.RGBA, width float64, dashed bool) {
	var p strings.Builder
	for i, q := range pts {
		if i > 0 {
			p.WriteByte(' ')
		}
		p.WriteString(ff(q[0]) + "," + ff(q[1]))
	}
	dash := ""
	if dashed {
		dash = ` stroke-dasharray="8,5"`
	}
	fmt.Fprintf(s.b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"%s\"/>\n", hex(c), ff(width), dash, p.String())
}

func escape(t string) string {
	r := strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;")
	return r.Replace(t)
}

func (s *svgCanvas) text(x, y float64, t string, anchor int, c color.RGBA) {
	a := [...]string{"start", "middle", "end"}[anchor]
	fmt.Fprintf(s.b, "<text x=\"%s\" y=\"%s\" font-family=\"monospace\" font-size=\"14\" text-anchor=\"%s\" fill=\"%s\">%s</text>\n", ff(x), ff(y), a, hex(c), escape(t))
}

func (s *svgCanvas) vtext(x, y float64, t string, c color.RGBA) {
	fmt.Fprintf(s.b, "<text transform=\"translate(%s,%s) rotate(-90)\" font-family=\"monospace\" font-size=\"14\" text-anchor=\"middle\" fill=\"%s\">%s</text>\n", ff(x+5), ff(y), hex(c), escape(t))
}

// PNG renders the chart as a PNG image.
func (c *Chart) PNG() ([]byte, error) {
	w, h := c.size()
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	for i := range img.Pix {
		img.Pix[i] = 255
	}
	c.draw(&pngCanvas{img: img})
	var b bytes.Buffer
	if err := png.Encode(&b, img); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

type pngCanvas struct{ img *image.RGBA }

func (p *pngCanvas) dot(x, y int, c color.RGBA, r int) {
	for dy := -r / 2; dy <= (r-1)/2; dy++ {
		for dx := -r / 2; dx <= (r-1)/2; dx++ {
			if image.Pt(x+dx, y+dy).In(p.img.Rect) {
				p.img.SetRGBA(x+dx, y+dy, c)
			}
		}
	}
}

func (p *pngCanvas) polyline(pts [][2]float64, c color.RGBA, width float64, dashed bool) {
	r := int(math.Round(width))
	if r < 1 {
		r = 1
	}
	if len(pts) == 1 {
		p.dot(int(pts[0][0]), int(pts[0][1]), c, r)
	}
	dist := 0.0
	for i := 1; i < len(pts); i++ {
		ax, ay, bx, by := pts[i-1][0], pts[i-1][1], pts[i][0], pts[i][1]
		n := int(math.Ceil(math.Max(math.Abs(bx-ax), math.Abs(by-ay))))
		if n == 0 {
			n = 1
		}
		step := math.Hypot(bx-ax, by-ay) / float64(n)
		for k := 0; k <= n; k++ {
			t := float64(k) / float64(n)
			if !dashed || math.Mod(dist, 13) < 8 {
				p.dot(int(math.Round(ax+(bx-ax)*t)), int(math.Round(ay+(by-ay)*t)), c, r)
			}
			if k < n {
				dist += step
			}
		}
	}
}

func (p *pngCanvas) glyph(x, y int, ch rune, c color.RGBA, vertical bool) {
	if ch >= 'a' && ch <= 'z' && ch != 'x' {
		ch -= 'a' - 'A'
	}
	g, ok := glyphs[ch]
	if !ok {
		return
	}
	for row := 0; row < 7; row++ {
		for col := 0; col < 5; col++ {
			if g[row][col] != '#' {
				continue
			}
			for sy := 0; sy < textScale; sy++ {
				for sx := 0; sx < textScale; sx++ {
					px, py := x+col*textScale+sx, y+row*textScale+sy
					if vertical { // rotate -90: (col,row) -> (row, -col)
						px, py = x+row*textScale+sx, y-col*textScale-sy
					}
					if image.Pt(px, py).In(p.img.Rect) {
						p.img.SetRGBA(px, py, c)
					}
				}
			}
		}
	}
}

func textWidth(s string) int { return len([]rune(s)) * glyphW * textScale }

func (p *pngCanvas) text(x, y float64, s string, anchor int, c color.RGBA) {
	w := textWidth(s)
	sx := int(x) - [...]int{0, w / 2, w}[anchor]
	top := int(y) - 7*textScale
	for i, ch := range []rune(s) {
		p.glyph(sx+i*glyphW*textScale, top, ch, c, false)
	}
}

func (p *pngCanvas) vtext(x, y float64, s string, c color.RGBA) {
	w := textWidth(s)
	sy := int(y) + w/2
	for i, ch := range []rune(s) {
		p.glyph(int(x)-7, sy-i*glyphW*textScale, ch, c, true)
	}
}
