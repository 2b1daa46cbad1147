/* Crop-aware JPEG decode on libjpeg-turbo: the `decode_and_crop_jpeg` of tf.data.
 *
 * decode_crop(data, y, x, h, w, scale_denom, fast_dct) decodes only the rows and iMCU columns
 * that the window (in full-resolution pixels) needs, at 1/scale_denom resolution (DCT
 * scaling; fast_dct picks JDCT_IFAST, tf.data's default), and returns (rgb_bytes, height,
 * width). The GIL is released while decoding.
 * Errors raise ValueError with libjpeg's message. Warnings (corrupt data that libjpeg
 * would paper over with grey, e.g. a truncated file) are errors too: a record is either
 * decoded faithfully or reported.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
  error_mgr *err = (error_mgr *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) cinfo->err->num_warnings++;
}

/* Decodes the window into a malloc'd RGB buffer; runs without the GIL. Returns 0 on
 * success, or -1 with `message` set. */
static int decode_window(const unsigned char *buf, unsigned long len, int y, int x, int h,
                         int w, int denom, int fast_dct, unsigned char **out, int *out_h, int *out_w,
                         char *message) {
  struct jpeg_decompress_struct cinfo;
  error_mgr err;
  unsigned char *volatile row = NULL;
  unsigned char *volatile result = NULL;

  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  if (setjmp(err.jump)) {
    strncpy(message, err.message, JMSG_LENGTH_MAX);
    jpeg_destroy_decompress(&cinfo);
    free(row);
    free(result);
    return -1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, buf, len);
  jpeg_read_header(&cinfo, TRUE);
  if (y < 0 || x < 0 || h <= 0 || w <= 0 || (unsigned)(y + h) > cinfo.image_height ||
      (unsigned)(x + w) > cinfo.image_width) {
    snprintf(err.message, sizeof(err.message), "crop (y=%d, x=%d, h=%d, w=%d) outside %ux%u",
             y, x, h, w, cinfo.image_height, cinfo.image_width);
    longjmp(err.jump, 1);
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = denom;
  cinfo.dct_method = fast_dct ? JDCT_IFAST : JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  /* The window in scaled coordinates, clipped to the scaled image. */
  int sy = y / denom, sx = x / denom, oh = h / denom, ow = w / denom;
  if (oh < 1) oh = 1;
  if (ow < 1) ow = 1;
  if ((unsigned)sy >= cinfo.output_height) sy = cinfo.output_height - 1;
  if ((unsigned)sx >= cinfo.output_width) sx = cinfo.output_width - 1;
  if ((unsigned)(sy + oh) > cinfo.output_height) oh = cinfo.output_height - sy;
  if ((unsigned)(sx + ow) > cinfo.output_width) ow = cinfo.output_width - sx;
  /* jpeg_crop_scanline widens the columns to iMCU boundaries: xoff <= sx. */
  JDIMENSION xoff = (JDIMENSION)sx, cw = (JDIMENSION)ow;
  if (cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw);
  /* Decode whole row groups straight into the result (cw wide), then drop the columns
   * left of the window in place. */
  size_t full = (size_t)cw * 3, n = (size_t)ow * 3, shift = (size_t)(sx - xoff) * 3;
  row = malloc(sizeof(JSAMPROW) * (size_t)oh);
  result = malloc((size_t)oh * full);
  if (row == NULL || result == NULL) {
    snprintf(err.message, sizeof(err.message), "out of memory");
    longjmp(err.jump, 1);
  }
  JSAMPROW *rowp = (JSAMPROW *)row;
  for (int r = 0; r < oh; r++) rowp[r] = result + (size_t)r * full;
  if (sy > 0) jpeg_skip_scanlines(&cinfo, sy);
  for (int r = 0; r < oh;) r += jpeg_read_scanlines(&cinfo, rowp + r, oh - r);
  for (int r = 0; r < oh; r++) memmove(result + (size_t)r * n, rowp[r] + shift, n);
  if (err.pub.num_warnings > 0) {
    (*err.pub.format_message)((j_common_ptr)&cinfo, err.message);
    longjmp(err.jump, 1);
  }
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  free(row);
  *out = result;
  *out_h = oh;
  *out_w = ow;
  return 0;
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
  Py_buffer data;
  int y, x, h, w, denom, fast_dct = 0, oh = 0, ow = 0, status;
  unsigned char *result = NULL;
  char message[JMSG_LENGTH_MAX] = {0};
  if (!PyArg_ParseTuple(args, "y*iiiii|p", &data, &y, &x, &h, &w, &denom, &fast_dct)) return NULL;
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError, "scale_denom must be 1, 2, 4 or 8");
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  status = decode_window((const unsigned char *)data.buf, (unsigned long)data.len, y, x, h, w,
                         denom, fast_dct, &result, &oh, &ow, message);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&data);
  if (status != 0) {
    PyErr_Format(PyExc_ValueError, "JPEG decode failed: %s", message);
    return NULL;
  }
  PyObject *out = PyBytes_FromStringAndSize((const char *)result, (Py_ssize_t)oh * ow * 3);
  free(result);
  if (out == NULL) return NULL;
  return Py_BuildValue("(Nii)", out, oh, ow);
}

/* (height, width) from the SOF marker, without libjpeg and without releasing the GIL:
 * it reads a few bytes, so handing the GIL to another thread would cost more. */
static PyObject *header(PyObject *self, PyObject *args) {
  Py_buffer data;
  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  const unsigned char *b = (const unsigned char *)data.buf;
  Py_ssize_t n = data.len, i = 2;
  long h = -1, w = -1;
  if (n < 4 || b[0] != 0xFF || b[1] != 0xD8) i = n;  /* not a JPEG */
  while (i + 3 < n) {
    if (b[i] != 0xFF) break;  /* lost sync: corrupt header */
    unsigned char m = b[i + 1];
    if (m == 0xFF) { i++; continue; }  /* fill byte */
    if (m == 0xD8 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) { i += 2; continue; }
    if (m == 0xD9 || m == 0xDA) break;  /* end of image or start of scan before any SOF */
    Py_ssize_t len = ((Py_ssize_t)b[i + 2] << 8) | b[i + 3];
    int sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (sof && i + 8 < n) {
      h = ((long)b[i + 5] << 8) | b[i + 6];
      w = ((long)b[i + 7] << 8) | b[i + 8];
      break;
    }
    if (len < 2) break;
    i += 2 + len;
  }
  PyBuffer_Release(&data);
  if (h <= 0 || w <= 0) {
    PyErr_SetString(PyExc_ValueError, "no JPEG frame header (SOF) with a valid size");
    return NULL;
  }
  return Py_BuildValue("(ll)", h, w);
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "header(data) -> (height, width) of a JPEG"},
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, y, x, h, w, scale_denom, fast_dct=False) -> (rgb bytes, height, width)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg",
                                    "Crop-aware JPEG decode (libjpeg-turbo).", -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
